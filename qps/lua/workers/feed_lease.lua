-- The lease of one feeder on the feed into a queue (workers/feedlease.py).
-- KEYS[1]: the lease (its holder's owner string); KEYS[2]: the wake list a standby
-- feeder blocks on.
-- ARGV[1]: the op; ARGV[2]: our owner string; ARGV[3]: the lease's time to live in ms;
-- ARGV[4] (takeover only): the holder found dead.
-- 'take' takes a free lease (or renews our own), 'takeover' also takes it from ARGV[4];
-- both reply {'ok'} or {'held', holder, its PTTL}. 'renew' renews ours: {'ok'}, or
-- {'lost', holder or ''}. 'release' drops ours and wakes a standby: {'ok'}.
local cur = redis.call('GET', KEYS[1])
local op = ARGV[1]
if op == 'take' or op == 'takeover' then
  if (not cur) or cur == ARGV[2] or (op == 'takeover' and cur == ARGV[4]) then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
    return {'ok'}
  end
  return {'held', cur, redis.call('PTTL', KEYS[1])}
elseif op == 'renew' then
  if cur ~= ARGV[2] then return {'lost', cur or ''} end
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'ok'}
end
if cur == ARGV[2] then
  redis.call('DEL', KEYS[1])
  redis.call('DEL', KEYS[2])
  redis.call('RPUSH', KEYS[2], '1')
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return {'ok'}
