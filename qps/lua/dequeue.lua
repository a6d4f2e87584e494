-- dequeue: A 2 id, 3 n, 4 mode (one|many|upto), 5 nowait (0/1), 6 id of the caller's
-- previous delivery record to drop ('-' for none), 7 acked (0/1): an acknowledged
-- dequeue keeps its delivery record and an 'r|<id>' lease until ack (ack.lua), nack
-- (nack.lua) or the lease running out, which puts the elements back. 8 wake (1 or
-- absent): the caller sent its first wait on a:<id>:w in the same round trip
-- (Client.script_then_wait), so any outcome but 'wait' pushes a token there.
-- Returns {'ok', elements}, {'wait'}, {'oor:<size>'}, {'wouldblock'}, {'aborted'}, {'gone'}.
local ID, N, MODE, NOWAIT, ACKED = A[2], tonumber(A[3]), A[4], (A[5] == '1'), (A[7] == '1')
local WAKE = (A[8] == '1')

local function attempt()
  local E = 'd|' .. A[3] .. '|' .. MODE .. (ACKED and 'A' or '') .. '|' .. ID
  if A[6] ~= '-' then fast_drop_record(P, A[6]) end  -- fast_common.lua
  if not KIND then return {'gone'} end
  if redis.call('EXISTS', akey(ID, 's')) == 1 then return {'aborted'} end
  reap()
  local hk = akey(ID, 'h')

  local function deliver_vals(vals, k)
    if not ACKED then vals = hand_over(ID, vals) end
    rpush_all(hk, vals)
    S.deq = S.deq + k
    if ACKED then
      lease_add('r|' .. ID)
    else
      redis.call('PEXPIRE', hk, RECORD_MS)
      chunk_ttl(vals, CHUNK_TTL_MS)
    end
    flush()
    return {'ok', vals}
  end

  local function deliver(k)
    return deliver_vals(take(k), k)
  end

  local first = (S.w == 0 or redis.call('LLEN', DW) == 0)  -- no dequeue waits ahead
  if first and LIST and not (CLOSED or NOWAIT) then
    -- An open list queue: pop what is there (usually all N) without counting first.
    local vals, have = {}, 0
    if S.x == 0 then
      vals = redis.call('LPOP', ITEMS, N) or {}
      have = #vals
    else
      local dx
      vals, have, dx = pop_elems(ITEMS, N)
      S.x = S.x + dx
    end
    if have == N then return deliver_vals(vals, N) end
    if have > 0 then rpush_all(hk, vals) end
  elseif first then
    local avail = takeable()
    if avail >= N then return deliver(N) end
    if CLOSED or NOWAIT then
      if MODE == 'upto' and avail > 0 then return deliver(avail) end
      -- closed: the end, unless an acknowledged dequeue may still get elements that
      -- other consumers hold (it waits for them: see holds())
      local wait = CLOSED and ACKED and avail == 0 and holds(ID)
      if CLOSED and not wait then return {'oor:' .. size()} end
      if NOWAIT then return {'wouldblock'} end
    end
    if avail > 0 then rpush_all(hk, take(avail)) end
  elseif NOWAIT then
    return {'wouldblock'}
  end
  redis.call('RPUSH', DW, E)
  lease_add(E)
  flush()
  local st = redis.call('GET', akey(ID, 's'))
  if st then return finalize(ID, st, ACKED) end
  return {'wait'}
end

local reply = attempt()
if WAKE and reply[1] ~= 'wait' then
  redis.call('RPUSH', akey(ID, 'w'), 1)
  redis.call('PEXPIRE', akey(ID, 'w'), RECORD_MS)
end
return reply
