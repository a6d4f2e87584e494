-- The enqueue fast path, run before the full script (qps.transport puts this file first
-- and the full script, queue_common.lua included, in a function called only when this
-- part falls through). It covers the common case with none of the full script's
-- set-up: an open list queue (FIFO, padding) with no attempt pending (w == 0) and room
-- for every element, none of them a reference to a large element's chunks (one batch
-- entry 'QB|...' alone is fine: its buffer's keys are persisted here). Anything else,
-- or a tombstone of this attempt, falls through to the full script.
do
  local M = redis.call('HMGET', KEYS[1], 'kind', 'cap', 'closed', 'w', 'x')
  local n = #ARGV - 1
  if (M[1] == 'fifo' or M[1] == 'padding') and M[3] == '0' and M[4] == '0'
      and n >= 1 and n <= 500 then
    local P = string.sub(KEYS[1], 1, -5)
    local id = string.match(ARGV[1], '^%S+ (%S+) 0$')  -- A: lease, id, nowait
    local plain = id ~= nil
    local count = n  -- elements
    -- A batch of rows of one buffer: 'QB|<bid>|<first row>|<rows>|<row bytes>'.
    local bid, rows
    if n == 1 then
      bid, rows = string.match(ARGV[2], '^QB|([^|]+)|%d+|(%d+)|%d+$')
    end
    if bid then
      count = tonumber(rows)
    else
      for i = 2, #ARGV do
        local b1, b2, b3 = string.byte(ARGV[i], 1, 3)
        if b1 == 81 and (b2 == 82 or b2 == 83 or b2 == 66) and b3 == 124 then
          plain = false  -- a QR|, QS| or QB| reference
        end
      end
    end
    if plain and redis.call('EXISTS', P .. 'a:' .. id .. ':s') == 0 then
      local items = P .. 'items'
      local cap = tonumber(M[2])
      local x = tonumber(M[5]) or 0
      if cap < 0 or redis.call('LLEN', items) + x + count <= cap then
        redis.call('RPUSH', items, unpack(ARGV, 2))
        if bid then
          redis.call('PERSIST', P .. 'b:' .. bid)
          redis.call('PERSIST', P .. 'b:' .. bid .. ':u')
          redis.call('HINCRBY', KEYS[1], 'x', count - 1)
        end
        redis.call('HINCRBY', KEYS[1], 'enq', count)
        return {'ok'}
      end
    end
  end
end
