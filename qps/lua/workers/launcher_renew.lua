-- Renew or drop the launcher's lease on a container (workers/lifecycle.py).
-- KEYS[1]: the lease. ARGV[1]: our record; ARGV[2]: the new time to live in ms, or ''
-- to delete the lease.
-- Replies 1 if the lease still held ARGV[1] (renewed or deleted), else 0 (untouched).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else
  redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
