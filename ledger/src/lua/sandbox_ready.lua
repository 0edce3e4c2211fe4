-- A created sandbox is ready: the longest-waiting request gets it, else it joins its pool.
-- KEYS: sbs, sb:sandbox, fence, expiry, active, unclaimed
-- ARGV: sandbox, container id
-- Reply (`Ready`): granted (to a waiter) | idle (in its pool) | stale (no longer 'creating':
-- destroy it)
local sb = ARGV[1]
local key = K.sb(sb)
if redis.call('HGET', key, 'state') ~= 'creating' then return reply({ outcome = 'stale' }) end
local template = redis.call('HGET', key, 'template')
redis.call('HSET', key, 'container', ARGV[2])
if grant_waiter(sb, template, now_ms()) then return reply({ outcome = 'granted' }) end
redis.call('HSET', key, 'state', 'idle')
redis.call('LPUSH', K.idle(template), sb)
return reply({ outcome = 'idle' })
