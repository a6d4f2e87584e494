-- The ack fast path (see enqueue_fast.lua): acknowledged deliveries of an open list queue
-- (FIFO, padding) whose records hold only plain elements and references to elements
-- stored in one chunk ('QR|<bid>|1|...': no batch entry, no element of several chunks).
-- It does what the full script does then: end each 'r|<id>' lease and drop its record
-- and the chunks it names. An open queue has nothing to flush: an
-- ack frees no room and adds no element. Any record with a reference, a lease run out,
-- or a closed queue falls through to the full script (nothing written before).
-- A: lease, then '+p' when the caller saw only plain values in the deliveries (the
-- client library knows: it decoded them), then the ids. With '+p' the records are not
-- read back (a value of tens of KB costs tens of microseconds to pass through Lua); a
-- caller that said '+p' wrongly would leave the out-of-line bytes to their TTL, or keep
-- them (persisted chunks of held elements), and nothing else.
do
  local P = string.sub(KEYS[1], 1, -5)
  local M = redis.call('HMGET', KEYS[1], 'kind', 'closed', 'w')
  local ids = {}
  for w in string.gmatch(ARGV[1], '%S+') do ids[#ids + 1] = w end  -- A: lease, ids
  local said = ids[2] == '+p'
  local first = said and 3 or 2
  if (M[1] == 'fifo' or M[1] == 'padding') and M[2] == '0' and #ids >= first
      and fast_count(M[3]) then
    local lease = P .. 'lease'
    local plain, chunks = true, {}
    for i = first, #ids do
      if not redis.call('ZSCORE', lease, 'r|' .. ids[i]) then
        plain = false  -- run out (the full script reports it)
        break
      end
      if not said then
        for _, v in ipairs(redis.call('LRANGE', P .. 'a:' .. ids[i] .. ':h', 0, -1)) do
          local b1, b2, b3 = string.byte(v, 1, 3)
          if b1 == 81 and (b2 == 82 or b2 == 83 or b2 == 66) and b3 == 124 then
            local bid = b2 == 82 and one_chunk_bid(v)
            if bid then  -- one chunk: dropped with the record
              chunks[#chunks + 1] = P .. 'b:' .. bid .. ':0'
            else
              plain = false  -- a QS| or QB| reference, or several chunks
            end
          end
        end
      end
      if not plain then break end
    end
    if plain then
      local gone = 0
      for i = first, #ids do
        gone = gone + redis.call('ZREM', lease, 'r|' .. ids[i])
        redis.call('DEL', P .. 'a:' .. ids[i] .. ':h')
      end
      if #chunks > 0 then redis.call('DEL', unpack(chunks)) end
      redis.call('HINCRBY', KEYS[1], 'w', -gone)
      return {'ok'}
    end
  end
end
