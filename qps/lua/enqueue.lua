-- enqueue: A 2 id, 3 nowait (0/1); ARGV[2..] encoded elements (or batch entries 'QB|...',
-- each standing for its rows). Inserts what fits now (a prefix, a batch entry split if
-- need be); the rest waits in a:<id>:p behind earlier attempts.
-- Returns {'ok'}, {'wait'}, {'closed'}, {'wouldblock'}, {'aborted'} or {'gone'}.
local ID, NOWAIT = A[2], (A[3] == '1')
local E = 'e|' .. ID
if not KIND then return {'gone'} end
local vals = argv_from(2)
if redis.call('EXISTS', akey(ID, 's')) == 1 then
  qs_drop(vals)
  return {'aborted'}
end
reap()
if CLOSED then
  qs_drop(vals)
  flush()
  return {'closed'}
end
local total = LIST and nelems(vals) or #vals
local k = 0
local first = (S.w == 0 or redis.call('LLEN', EW) == 0)  -- no enqueue waits ahead
if first and LIST and not NOWAIT and CAP >= 0 and total <= 8 and total == #vals then
  -- A bounded list queue and a few values: push first, then take back the part of our
  -- own tail that does not fit (it waits as pending below). Saves counting first in the
  -- common case. The list may already hold more than CAP (elements given back by a
  -- dequeue), so only our values are ever removed. A larger batch counts first: pushing
  -- and popping back many values into a full queue costs more than one LLEN.
  chunk_ttl(vals, nil)
  local before = redis.call('RPUSH', ITEMS, unpack(vals)) - total
  k = math.max(0, math.min(total, CAP - before))
  if k < total then redis.call('RPOP', ITEMS, total - k) end
  S.enq = S.enq + k
elseif first then
  k = total
  if CAP >= 0 then k = math.min(total, math.max(0, CAP - size())) end
  if NOWAIT and k < total then
    qs_drop(vals)
    flush()
    return {'wouldblock'}
  end
  if k > 0 then
    if k < total then
      push_back((split_elems(vals, k)))
    else
      push_back(vals)
    end
    S.enq = S.enq + k
  end
elseif NOWAIT then
  qs_drop(vals)
  flush()
  return {'wouldblock'}
end
if k == total then
  flush()
  return {'ok'}
end
local _, rest = split_elems(vals, k)
rpush_all(akey(ID, 'p'), rest)
chunk_ttl(rest, nil)
redis.call('RPUSH', EW, E)
lease_add(E)
flush()
local st = redis.call('GET', akey(ID, 's'))
if st then return finalize(ID, st) end
return {'wait'}
