-- A processing list given back to its gradient list. KEYS[1]: the processing list,
-- KEYS[2]: the gradient list. ARGV[1]: the tombstone (an element acknowledged out of
-- order). Moves the processing list's elements, tombstones dropped, to the front of the
-- list in order, and deletes it. Reply: how many it moved.
local vs = redis.call('LRANGE', KEYS[1], 0, -1)
local n = 0
for i = #vs, 1, -1 do
  if vs[i] ~= ARGV[1] then
    redis.call('LPUSH', KEYS[2], vs[i])
    n = n + 1
  end
end
redis.call('DEL', KEYS[1])
return n
