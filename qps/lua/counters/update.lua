-- A counter's add or set. KEYS[1]: the counter; ARGV[1]: 'add' or 'set'; ARGV[2]: the
-- amount or the new value. Changes the counter only if it exists (a counter removed by
-- a reset stays removed instead of coming back at 0). Replies {'ok', the value after an
-- add or before a set}, {'gone'}, or {'err', message}. Values are strings: Lua numbers
-- are doubles, and an int64 must come back exact. A stored value that is no int64 is
-- left as it is: 'add' fails in INCRBY, 'set' checks it first with INCRBY 0 (a no-op on
-- an int64), so that the previous value it returns is one.
local old = redis.pcall('GET', KEYS[1])
if type(old) == 'table' and old.err then return {'err', old.err} end
if not old then return {'gone'} end
if ARGV[1] == 'add' then
  local r = redis.pcall('INCRBY', KEYS[1], ARGV[2])
  if type(r) == 'table' and r.err then return {'err', r.err} end
  return {'ok', redis.call('GET', KEYS[1])}
end
local r = redis.pcall('INCRBY', KEYS[1], 0)
if type(r) == 'table' and r.err then return {'err', r.err} end
redis.call('SET', KEYS[1], ARGV[2])
return {'ok', old}
