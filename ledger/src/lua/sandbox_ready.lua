-- A created sandbox is ready: 'creating' becomes 'idle' and joins its pool.
-- ARGV: base, sandbox, container id. Returns 1, or 0 if the sandbox is no longer 'creating'.
local key = base .. 'sb:' .. ARGV[2]
if redis.call('HGET', key, 'state') ~= 'creating' then return 0 end
local template = redis.call('HGET', key, 'template')
redis.call('HSET', key, 'state', 'idle', 'container', ARGV[3])
redis.call('LPUSH', base .. 'idle:' .. template, ARGV[2])
return 1
