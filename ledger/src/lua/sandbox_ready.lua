-- A created sandbox is ready: the longest-waiting request gets it, else it joins its pool.
-- ARGV: base, sandbox, container id.
-- Returns 2 (granted to a waiter), 1 (now idle), or 0 (no longer 'creating': destroy it).
local sb = ARGV[2]
local key = base .. 'sb:' .. sb
if redis.call('HGET', key, 'state') ~= 'creating' then return 0 end
local template = redis.call('HGET', key, 'template')
redis.call('HSET', key, 'container', ARGV[3])
if grant_waiter(sb, template, now_ms()) then return 2 end
redis.call('HSET', key, 'state', 'idle')
redis.call('LPUSH', base .. 'idle:' .. template, sb)
return 1
