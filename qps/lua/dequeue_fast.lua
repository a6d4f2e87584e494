-- The dequeue fast path (see enqueue_fast.lua): an open list queue with no attempt
-- pending and no lease run out (leases of acknowledged deliveries that consumers hold
-- may be there: with no attempt pending there is nothing to flush, and nothing to reap)
-- that holds at least n elements, either as plain entries (x == 0: one element per
-- entry) or as a batch entry 'QB|...' at the head with at least n rows. It does what the
-- full script does in that case: take n, keep them as the delivery record a:<id>:h, count
-- them, and give out-of-line chunks of delivered large elements their TTL. An
-- acknowledged dequeue (of one plain element here) keeps its record and gets an
-- 'r|<id>' lease instead, until the ack. An empty one (and a dequeue that may wait):
-- register the attempt, as the full script does then (nothing to serve, nothing pending
-- to flush).
do
  local P = string.sub(KEYS[1], 1, -5)
  -- A: lease, id, n, mode, nowait, previous delivery record, acked (0/1), and wake
  -- (optional: 1 if the caller's wait follows in its pipeline; see dequeue.lua)
  local ms, id, n, mode, nowait, prev, acked, wake =
    string.match(ARGV[1], '^(%S+) (%S+) (%d+) (%a+) ([01]) (%S+) ([01]) ?([01]?)$')
  local function woken(reply)
    if wake == '1' then
      redis.call('RPUSH', P .. 'a:' .. id .. ':w', 1)
      redis.call('PEXPIRE', P .. 'a:' .. id .. ':w', 60000)  -- RECORD_MS
    end
    return reply
  end
  local function now_ms()
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  local function chunk_ttl(v)  -- a large element's reference: its chunks get their TTL
    local b1, b2, b3 = string.byte(v, 1, 3)
    if b1 == 81 and b2 == 82 and b3 == 124 then  -- 'QR|'
      local bid, c = string.match(string.sub(v, 1, 64), '^QR|([^|]+)|(%d+)|')
      if bid and tonumber(c) <= 2048 then  -- more: a corrupt reference (MAX_CHUNKS)
        for k = 0, tonumber(c) - 1 do
          redis.call('PEXPIRE', P .. 'b:' .. bid .. ':' .. k, 600000)  -- CHUNK_TTL_MS
        end
      end
    end
  end
  n = tonumber(n)
  if prev and prev ~= '-' then fast_drop_record(P, prev) end  -- fast_common.lua
  local M = redis.call('HMGET', KEYS[1], 'kind', 'closed', 'w', 'x')
  local items = P .. 'items'
  local lease = P .. 'lease'
  -- w counts the attempts pending and the leases of held deliveries together
  local W, X = fast_count(M[3]), fast_count(M[4])  -- nil: left to the full script
  local quiet = W == 0
  if W and X and not quiet and id and redis.call('LLEN', P .. 'dw') == 0
      and redis.call('LLEN', P .. 'ew') == 0 then
    quiet = #redis.call('ZRANGEBYSCORE', lease, '-inf', now_ms(), 'LIMIT', 0, 1) == 0
  end
  if id and X and (M[1] == 'fifo' or M[1] == 'padding') and M[2] == '0' and quiet
      and (acked == '0' or n == 1) and n >= 1 and n <= 500
      and redis.call('EXISTS', P .. 'a:' .. id .. ':s') == 0 then
    local hk = P .. 'a:' .. id .. ':h'
    local x = X
    local len
    if x == 0 and n == 1 then
      -- one plain element: moved into the delivery record in one call
      local v = redis.call('LMOVE', items, hk, 'LEFT', 'RIGHT')
      if v then  -- an element stored out of line in one chunk: the chunk goes along
        local given = fast_take_chunk(P, v, id)
        if given ~= v then
          redis.call('LSET', hk, -1, given)
          v = given
        end
      end
      if v and acked == '1' then
        redis.call('ZADD', lease, now_ms() + tonumber(ms), 'r|' .. id)
        redis.call('HINCRBY', KEYS[1], 'w', '1')
        redis.call('HINCRBY', KEYS[1], 'deq', '1')
        return woken({'ok', {v}})
      elseif v then
        redis.call('PEXPIRE', hk, 60000)  -- RECORD_MS
        chunk_ttl(v)
        redis.call('HINCRBY', KEYS[1], 'deq', '1')
        return woken({'ok', {v}})
      end
      len = 0
    else
      len = redis.call('LLEN', items)
    end
    if acked == '0' and x == 0 and len >= n then
      local vals = redis.call('LPOP', items, n)
      redis.call('RPUSH', hk, unpack(vals))
      redis.call('PEXPIRE', hk, 60000)  -- RECORD_MS
      for _, v in ipairs(vals) do
        chunk_ttl(v)
      end
      redis.call('HINCRBY', KEYS[1], 'deq', n)
      return woken({'ok', vals})
    elseif acked == '0' and x > 0 then
      local head = redis.call('LINDEX', items, 0)
      local bid, first, rows, size
      if head then
        bid, first, rows, size = string.match(head, '^QB|([^|]+)|(%d+)|(%d+)|(%d+)$')
      end
      rows = tonumber(rows)
      if bid and rows >= n and tonumber(size) >= 1 then
        local v, dx = head, 1 - n
        if rows == n then
          redis.call('LPOP', items)
          -- the last unread rows take their buffer along (fast_common.lua)
          v = fast_hand_over(P, bid, id, first, n, size) or v
        else
          dx = -n
          first = tonumber(first)
          v = string.format('QB|%s|%d|%d|%s', bid, first, n, size)
          redis.call('LSET', items, 0,
            string.format('QB|%s|%d|%d|%s', bid, first + n, rows - n, size))
        end
        redis.call('RPUSH', hk, v)
        redis.call('PEXPIRE', hk, 60000)  -- RECORD_MS
        redis.call('HINCRBY', KEYS[1], 'x', dx)
        redis.call('HINCRBY', KEYS[1], 'deq', n)
        return woken({'ok', {v}})
      end
    elseif x == 0 and len == 0 and nowait == '0' then  -- wait (lease_add, as the full script)
      local e = 'd|' .. n .. '|' .. mode .. (acked == '1' and 'A' or '') .. '|' .. id
      redis.call('RPUSH', P .. 'dw', e)
      redis.call('ZADD', lease, now_ms() + tonumber(ms), e)
      redis.call('HINCRBY', KEYS[1], 'w', 1)
      return {'wait'}
    end
  end
end
