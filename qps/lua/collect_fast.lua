-- The collect fast paths (see enqueue_fast.lua). First: a non-acknowledged dequeue whose
-- attempt finished ('ok') while its caller waited, with no lease of any attempt run out (else
-- the full script reaps first) and no large element of several chunks among its
-- elements. It does what finalize does then: drop the caller's previous record, hand
-- out the delivery record a:<id>:h (kept RECORD_MS for a caller cancelled before it
-- reads the reply), give one-chunk elements' chunks their TTL and end the 'r|<id>'
-- lease.
do
  local P = string.sub(KEYS[1], 1, -5)
  local e, id, prev = string.match(ARGV[1], '^%S+ (%S+) (%S+) (%S+)$')  -- lease, entry, id, prev
  if e and string.sub(e, 1, 2) == 'd|' and not string.match(e, '^d|%d+|%a+A|') then
    local lease = P .. 'lease'
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local st = redis.call('GET', P .. 'a:' .. id .. ':s')
    if st == 'ok' and #redis.call('ZRANGEBYSCORE', lease, '-inf', now, 'LIMIT', 0, 1) == 0 then
      local hk = P .. 'a:' .. id .. ':h'
      local vals = redis.call('LRANGE', hk, 0, -1)
      local plain, chunks = true, {}
      for _, v in ipairs(vals) do
        local b1, b2, b3 = string.byte(v, 1, 3)
        if b1 == 81 and b2 == 82 and b3 == 124 then  -- 'QR|': one chunk only
          local bid = one_chunk_bid(v)
          if bid then chunks[#chunks + 1] = P .. 'b:' .. bid .. ':0' else plain = false end
        end
      end
      if plain and (#vals > 0 or redis.call('EXISTS', hk) == 1) then
        if prev ~= '-' then fast_drop_record(P, prev) end  -- fast_common.lua
        redis.call('DEL', P .. 'a:' .. id .. ':s', P .. 'a:' .. id .. ':w')
        if redis.call('ZREM', lease, 'r|' .. id) > 0 then
          redis.call('HINCRBY', KEYS[1], 'w', -1)
        end
        redis.call('PEXPIRE', hk, 60000)  -- RECORD_MS
        for _, ck in ipairs(chunks) do  -- delivered: expire unless dropped first
          redis.call('PEXPIRE', ck, 600000)  -- CHUNK_TTL_MS
        end
        return {'ok', vals}
      end
    end
  elseif e and string.match(e, '^d|%d+|%a+A|') then
    -- An acknowledged dequeue's finished attempt, on an open queue (a closed one may
    -- have waits to end: the full script flushes) with no lease run out: finalize with
    -- keep (queue_common.lua). The record and the 'r|<id>' lease stay until the ack.
    local lease = P .. 'lease'
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local st = redis.call('GET', P .. 'a:' .. id .. ':s')
    if st == 'ok' and redis.call('HGET', KEYS[1], 'closed') == '0'
        and #redis.call('ZRANGEBYSCORE', lease, '-inf', now, 'LIMIT', 0, 1) == 0 then
      if prev ~= '-' then fast_drop_record(P, prev) end  -- fast_common.lua
      redis.call('DEL', P .. 'a:' .. id .. ':s', P .. 'a:' .. id .. ':w')
      if redis.call('ZSCORE', lease, 'r|' .. id) then
        return {'ok', redis.call('LRANGE', P .. 'a:' .. id .. ':h', 0, -1)}
      end
      return {'expired'}
    end
  end
end
