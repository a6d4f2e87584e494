-- A PS shard's lease (qps.ps.lease). KEYS[1]: the lease ("<token> <owner>"), KEYS[2]:
-- the wake list a standby blocks on. ARGV[1]: 'acquire', 'takeover', 'renew' or
-- 'release'; ARGV[2]: the lease value; ARGV[3]: its length (ms); ARGV[4] (takeover):
-- the dead holder's value to take it over from.
-- Replies: acquire {'ok'} or {'held', its PTTL, its value}; takeover {'ok'} or
-- {'moved'} (no longer the dead holder's); renew and release {'ok'} or {'lost', the
-- value now held or ''}. A release wakes one standby.
local op = ARGV[1]
if op == 'acquire' then
  if redis.call('SET', KEYS[1], ARGV[2], 'NX', 'PX', ARGV[3]) then return {'ok'} end
  return {'held', redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[1])}
end
if op == 'takeover' then
  if redis.call('GET', KEYS[1]) ~= ARGV[4] then return {'moved'} end
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return {'ok'}
end
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[2] then return {'lost', cur or ''} end
if op == 'renew' then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'ok'}
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('RPUSH', KEYS[2], '1')
redis.call('PEXPIRE', KEYS[2], 60000)
return {'ok'}
