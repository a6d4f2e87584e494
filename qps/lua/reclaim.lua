-- reclaim: A 2 'count' or 'undo'. What this queue's consumers hold: pending deliveries
-- of acknowledged dequeues ('r|<id>'), and dequeues still registered as waiting
-- ('d|...', with whatever was handed to them). 'count' returns {'ok', n}; 'undo' puts
-- their elements back at the front and cancels the waits, as if every such lease had run
-- out now, and returns {'ok', n}. Waiting enqueues are left alone.
-- For a queue with one consumer that restarted (a PS shard's gradient queue, whose new
-- owner holds the shard's lease): what its dead predecessors held, back at once instead
-- of when their leases run out.
-- A 2 'enqueues', A 3 a client id: undo the waiting enqueues of that client (attempts
-- 'e|<client>.<n>'): their not-yet-inserted elements are dropped, their inserted prefixes
-- stay, as if their leases had run out now; returns {'ok', n}. For a producer that
-- restarted and knows its dead predecessor's client id (a feeder resuming its feed).
if not KIND then return {'gone'} end
if A[2] == 'enqueues' then
  local pre = 'e|' .. A[3] .. '.'
  local n = 0
  for _, e in ipairs(redis.call('ZRANGE', LEASE, 0, -1)) do
    if string.sub(e, 1, #pre) == pre then
      local id = undo(e)
      redis.call('SET', akey(id, 's'), 'aborted', 'PX', RECORD_MS)
      n = n + 1
    end
  end
  flush()
  return {'ok', n}
end
local held = {}
for _, e in ipairs(redis.call('ZRANGE', LEASE, 0, -1)) do
  local t = string.sub(e, 1, 1)
  if t == 'r' or t == 'd' then held[#held + 1] = e end
end
if A[2] ~= 'undo' then return {'ok', #held} end
-- newest first: each undo puts its elements at the front, so the oldest end up first
-- (attempt ids are '<client>.<counter>')
local function key(e)
  local c, n = string.match(e, '([%w]+)%.(%d+)$')
  return c or '', tonumber(n) or 0
end
table.sort(held, function(a, b)
  local ca, na = key(a)
  local cb, nb = key(b)
  if ca ~= cb then return ca > cb end
  return na > nb
end)
for _, e in ipairs(held) do
  local id = undo(e)
  redis.call('SET', akey(id, 's'), 'expired', 'PX', RECORD_MS)
end
flush()
return {'ok', #held}
