-- Reads runs of a variable's current generation in one atomic step (qps.varread: the
-- rows of read_rows, or a small value whole). KEYS[1]: the meta hash P meta. ARGV[1]:
-- ranges "segment first last,..." (byte offsets in the segment, passed to GETRANGE as
-- the text they are: no number formatting in Lua; a last of -1: the segment's end).
-- Replies {'ok', version, gen, one string per range} or {'gone'}.
local P = string.sub(KEYS[1], 1, -5)
local function seg_key(gen, i) return P .. 'd:' .. gen .. ':' .. i end
local m = redis.call('HMGET', KEYS[1], 'gen', 'ver')
if not m[1] then return {'gone'} end
local out = {'ok', m[2], m[1]}
local n = 3
local call = redis.call
local names = {}
for seg, lo, hi in string.gmatch(ARGV[1], '(%d+) (%d+) (-?%d+)') do
  local k = names[seg]
  if not k then
    k = seg_key(m[1], seg)
    names[seg] = k
  end
  n = n + 1
  out[n] = call('GETRANGE', k, lo, hi)
end
return out
