-- A lease (qps/lease.py): a key one holder at a time owns, with a time to live its
-- holder renews. Shard leases, feed leases and launcher leases are all this script.
-- KEYS[1]: the lease (its holder's value); KEYS[2], if given: the wake list a waiting
-- taker blocks on.
-- ARGV[1]: 'take', 'renew' or 'release'; ARGV[2]: our value; ARGV[3]: the time to live
-- (ms); ARGV[4] (take): a holder's value we may replace (one found dead), or ''.
-- take: sets the lease if it is free, ours, or holds ARGV[4]: {'ok'}; else
-- {'held', the holder's value, its PTTL}.
-- renew, release: {'ok'} if the lease holds our value (its time to live set again, or
-- deleted and one waiter woken), else {'lost', the value now held or ''}.
local cur = redis.call('GET', KEYS[1])
local op = ARGV[1]
if op == 'take' then
  if (not cur) or cur == ARGV[2] or (ARGV[4] ~= '' and cur == ARGV[4]) then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
    return {'ok'}
  end
  return {'held', cur, redis.call('PTTL', KEYS[1])}
end
if cur ~= ARGV[2] then return {'lost', cur or ''} end
if op == 'renew' then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'ok'}
end
redis.call('DEL', KEYS[1])
if KEYS[2] then
  redis.call('DEL', KEYS[2])
  redis.call('RPUSH', KEYS[2], '1')
  redis.call('PEXPIRE', KEYS[2], 60000)
end
return {'ok'}
