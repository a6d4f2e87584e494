-- KEYS: a list queue's items, its ew list. Returns {bytes of the stored elements, bytes
-- of the elements pending enqueues wait to insert}: an element stored inline counts its
-- length, one stored out of line (a reference 'QR|..|<bytes>', a batch row 'QS|..|<row
-- bytes>', a batch entry 'QB|..|<rows>|<row bytes>') the bytes it stands for. Reads the
-- list in slices of 16 values, so a long queue of large inline elements never sits in
-- the script's memory at once. A pending enqueue's values are in a:<id>:p (same hash tag).
local P = string.sub(KEYS[1], 1, -6)
local function size(v)
  local tag = string.sub(v, 1, 3)
  if tag == 'QR|' or tag == 'QS|' then
    return tonumber(string.match(v, '|(%d+)$')) or #v
  elseif tag == 'QB|' then
    local rows, each = string.match(v, '|(%d+)|(%d+)$')
    if rows then return tonumber(rows) * tonumber(each) end
  end
  return #v
end
local function total(key)
  local n, bytes = redis.call('LLEN', key), 0
  for i = 0, n - 1, 16 do
    for _, v in ipairs(redis.call('LRANGE', key, i, i + 15)) do bytes = bytes + size(v) end
  end
  return bytes
end
local pending = 0
for _, e in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  if string.sub(e, 1, 2) == 'e|' then
    pending = pending + total(P .. 'a:' .. string.sub(e, 3) .. ':p')
  end
end
return {total(KEYS[1]), pending}
