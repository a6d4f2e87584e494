-- create: ARGV 2 kind, 3 spec (JSON), 4 capacity, 5 min_after_dequeue, 6 RNG seed.
-- Returns {'created'} or {'exists', <spec of the existing queue>}; the caller compares.
if KIND then
  return {'exists', redis.call('HGET', META, 'spec')}
end
redis.call('HSET', META, 'kind', ARGV[2], 'spec', ARGV[3], 'cap', ARGV[4], 'min', ARGV[5],
  'closed', 0, 'enq', 0, 'deq', 0, 'n', 0, 'rng', ARGV[6], 'ctime', NOW)
return {'created'}
