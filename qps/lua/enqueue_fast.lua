-- The enqueue fast path, run before the full script (qps.transport puts this file first
-- and the full script, queue_common.lua included, in a function called only when this
-- part falls through). It covers the common case with none of the full script's
-- set-up: an open list queue (FIFO, padding) with no attempt pending and room
-- for every element, none of them a reference to a large element's chunks (one batch
-- entry 'QB|...', or one reference 'QR|<bid>|1|...' to an element in one chunk, alone is
-- fine: its keys are persisted here). Anything else, or a tombstone of this attempt,
-- falls through to the full script.
-- A second case: one value for the one attempt pending, a dequeue waiting on an empty
-- queue with its lease valid, for exactly what the value stands for: a plain element
-- or a one-chunk reference for a dequeue of one (acknowledged or not), or a buffer's
-- batch entry 'QB|...' for a dequeue that is not acknowledged of exactly its rows. Hand
-- it over as the full script's flush would (its delivery record, the 'r|' lease, its
-- outcome and wake token; a buffer goes along renamed after the attempt, as hand_over
-- does, and so does a chunk, as the dequeue fast path does).
-- Both hold with acknowledged deliveries held by consumers ('r|' leases: w counts them
-- too) as long as none of those leases has run out (the full script would put those
-- elements back first).
local M = redis.call('HMGET', KEYS[1], 'kind', 'cap', 'closed', 'w', 'x')
local W = fast_count(M[4])
-- fields that are not what qps writes leave the call to the full script (it reports them)
local CAPV = M[2] and tonumber(M[2])
local SANE = W and fast_count(M[5]) and CAPV and CAPV >= -1 and CAPV == math.floor(CAPV)
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function lapsed(lease, now)  -- whether some lease has run out
  return #redis.call('ZRANGEBYSCORE', lease, '-inf', now, 'LIMIT', 0, 1) > 0
end
do
  local P = string.sub(KEYS[1], 1, -5)
  local ms, id = string.match(ARGV[1], '^(%S+) (%S+) 0$')  -- A: lease, id, nowait
  local cap = CAPV
  if SANE and W >= 1 and id and #ARGV == 2 and (M[1] == 'fifo' or M[1] == 'padding')
      and M[3] == '0' and (tonumber(M[5]) or 0) == 0 and cap ~= 0 then
    local v = ARGV[2]
    local b1, b2, b3 = string.byte(v, 1, 3)
    local ref = b1 == 81 and (b2 == 82 or b2 == 83 or b2 == 66) and b3 == 124
    local bid, first, rows, size  -- a batch entry: the rows of buffer b:<bid>
    if ref and b2 == 66 then
      bid, first, rows, size = string.match(v, '^QB|([^|]+)|(%d+)|(%d+)|(%d+)$')
      rows = tonumber(rows)
    end
    local count = bid and rows or 1
    -- an element stored out of line in one chunk: 'QR|<cid>|1|<bytes>'
    local cid = ref and b2 == 82 and one_chunk_bid(v)
    local dw = P .. 'dw'
    if (not ref or bid or cid) and (cap < 0 or count <= cap)
        and redis.call('LLEN', P .. 'ew') == 0 and redis.call('LLEN', dw) == 1
        and redis.call('LLEN', P .. 'items') == 0
        and redis.call('EXISTS', P .. 'a:' .. id .. ':s') == 0 then
      local e = redis.call('LINDEX', dw, 0)
      local n, mode, did = string.match(e, '^d|(%d+)|(%a+)|(.+)$')
      local lease = P .. 'lease'
      local now = now_ms()
      if n and tonumber(n) == count and not (bid and string.sub(mode, -1) == 'A')
          and redis.call('LLEN', P .. 'a:' .. did .. ':h') == 0
          and (tonumber(redis.call('ZSCORE', lease, e)) or 0) > now
          and (W == 1 or not lapsed(lease, now)) then
        if bid then  -- the buffer goes along (fast_common.lua), else the full script
          v = fast_hand_over(P, bid, did, first, rows, size)
        elseif cid then  -- the chunk goes along (fast_common.lua): held chunks persist,
          local ck  -- delivered ones expire unless dropped first
          v, ck = fast_take_chunk(P, v, did)
          if string.sub(mode, -1) == 'A' then
            redis.call('PERSIST', ck)
          else
            redis.call('PEXPIRE', ck, 600000)  -- CHUNK_TTL_MS
          end
        end
      else
        v = nil
      end
      if v then
        local hk, wk = P .. 'a:' .. did .. ':h', P .. 'a:' .. did .. ':w'
        redis.call('RPUSH', hk, v)
        redis.call('LPOP', dw)
        redis.call('ZREM', lease, e)
        redis.call('ZADD', lease, now + tonumber(ms), 'r|' .. did)
        redis.call('SET', P .. 'a:' .. did .. ':s', 'ok', 'PX', 60000)  -- RECORD_MS
        redis.call('RPUSH', wk, 1)
        redis.call('PEXPIRE', wk, 60000)
        redis.call('HINCRBY', KEYS[1], 'enq', count)
        redis.call('HINCRBY', KEYS[1], 'deq', count)
        return {'ok'}
      end
    end
  end
end
do
  local n = #ARGV - 1
  local P = string.sub(KEYS[1], 1, -5)
  local quiet = W == 0
  if SANE and not quiet and redis.call('LLEN', P .. 'ew') == 0 and redis.call('LLEN', P .. 'dw') == 0 then
    quiet = not lapsed(P .. 'lease', now_ms())
  end
  if SANE and (M[1] == 'fifo' or M[1] == 'padding') and M[3] == '0' and quiet
      and n >= 1 and n <= 500 then
    local id = string.match(ARGV[1], '^%S+ (%S+) 0$')  -- A: lease, id, nowait
    local plain = id ~= nil
    local count = n  -- elements
    -- A batch of rows of one buffer: 'QB|<bid>|<first row>|<rows>|<row bytes>'.
    local bid, rows, chunk
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
      if id and not plain and n == 1 then  -- one element stored out of line in one chunk
        chunk = one_chunk_bid(ARGV[2])
        plain = chunk ~= nil
      end
    end
    if plain and redis.call('EXISTS', P .. 'a:' .. id .. ':s') == 0 then
      local items = P .. 'items'
      local cap = tonumber(M[2])
      local x = tonumber(M[5]) or 0
      -- pushed first, taken back if there was no room (the full script then waits):
      -- the common case needs no LLEN
      local len = redis.call('RPUSH', items, unpack(ARGV, 2))
      if cap >= 0 and len - n + x + count > cap then
        redis.call('RPOP', items, n)
      else
        if bid then
          redis.call('PERSIST', P .. 'b:' .. bid)
          redis.call('PERSIST', P .. 'b:' .. bid .. ':u')
          redis.call('HINCRBY', KEYS[1], 'x', count - 1)
        elseif chunk then
          redis.call('PERSIST', P .. 'b:' .. chunk .. ':0')
        end
        redis.call('HINCRBY', KEYS[1], 'enq', count)
        return {'ok'}
      end
    end
  end
end
