-- release needs none of the queue library: it always finishes here (see release.lua).
do
  local P = string.sub(KEYS[1], 1, -5)
  local A = {}
  for w in string.gmatch(ARGV[1], '%S+') do A[#A + 1] = w end
  for i = 2, #A - 1, 2 do
    local bk = P .. 'b:' .. A[i]
    -- a corrupt count (no integer) is left as it is, and the buffer with it: the rows
    -- were read, and failing here would set them aside
    local left = redis.pcall('DECRBY', bk .. ':u', tonumber(A[i + 1]))
    if type(left) == 'number' and left <= 0 then
      redis.call('DEL', bk, bk .. ':u')
    end
  end
  return {'ok'}
end
