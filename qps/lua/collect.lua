-- collect: A 2 entry, 3 id, 4 previous delivery record to drop ('-' for none).
-- Run by a blocked caller after each wait: the outcome if its attempt finished, else
-- {'pending'} after renewing its lease. Also reaps attempts of dead callers.
local E, ID = A[2], A[3]
if A[4] ~= '-' then fast_drop_record(P, A[4]) end  -- fast_common.lua
if reap() or CLOSED then flush() end  -- closed: a wait on held elements may end
local st = redis.call('GET', akey(ID, 's'))
if st then return finalize(ID, st, acked_entry(E)) end
if not KIND then return {'gone'} end
if not redis.call('ZSCORE', LEASE, E) then return {'expired'} end
redis.call('ZADD', LEASE, 'XX', now() + LEASE_MS, E)
return {'pending'}
