-- ack: A 2.. ids of acknowledged dequeues whose elements their caller is done with,
-- after an optional '+p' (the caller saw no reference among them: see ack_fast.lua).
-- The delivery records go, with the out-of-line bytes of their elements. Returns
-- {'ok'} or {'expired', id...}: those leases had run out and their elements were put
-- back (they will be delivered again).
if not KIND then return {'gone'} end
local lost = {}
for i = (A[2] == '+p') and 3 or 2, #A do
  local id = A[i]
  local hk = akey(id, 'h')
  local vals = redis.call('LRANGE', hk, 0, -1)  -- first: a corrupt record fails before a write
  if lease_del('r|' .. id) == 0 then
    lost[#lost + 1] = id
  else
    redis.call('DEL', hk)
    chunk_ttl(vals, 1)
    qs_drop(vals)
  end
end
flush()  -- on a closed queue, acknowledged dequeues waiting for these may end now
if #lost > 0 then return {'expired', unpack(lost)} end
return {'ok'}
