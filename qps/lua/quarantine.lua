-- quarantine: ARGV[2..] dead-letter records (element bytes plus reason) for the dlq list.
local dlq = P .. 'dlq'
rpush_all(dlq, argv_from(2))
redis.call('HINCRBY', META, 'bad', #ARGV - 1)
return {'ok'}
