-- close: A 2 id, 3 cancel_pending_enqueues (0/1).
-- Without cancel the close joins the end of the enqueue attempts and applies once the
-- earlier ones are done. Returns {'ok'}, {'wait'}, {'already'} or {'gone'}.
local ID, CANCEL = A[2], (A[3] == '1')
local E = 'c|' .. ID
if not KIND then return {'gone'} end
reap()
if CLOSED then
  if CANCEL then return {'ok'} end
  return {'already'}
end
if CANCEL then
  set_closed()
  cancel_enqueues('cancelled')
  flush()
  return {'ok'}
end
if S.w == 0 or redis.call('LLEN', EW) == 0 then
  set_closed()
  flush()
  return {'ok'}
end
redis.call('RPUSH', EW, E)
lease_add(E)
return {'wait'}
