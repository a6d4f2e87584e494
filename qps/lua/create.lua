-- create: A 2 kind, 3 capacity, 4 min_after_dequeue, 5 RNG seed; ARGV[2] spec (JSON).
-- Returns {'created'} or {'exists', <spec of the existing queue>}; the caller compares.
if KIND then
  return {'exists', redis.call('HGET', META, 'spec')}
end
redis.call('HSET', META, 'kind', A[2], 'spec', ARGV[2], 'cap', A[3], 'min', A[4],
  'closed', 0, 'enq', 0, 'deq', 0, 'n', 0, 'rng', A[5], 'w', 0, 'ctime', now())
return {'created'}
