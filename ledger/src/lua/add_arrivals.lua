-- Count session requests of one template in the current second of Redis's clock (not a
-- node script: one template's counts share the hash tag of KEYS[1]).
-- KEYS: the template's arrivals scope (P:{arr:<template>}:); the script appends the second
-- ARGV: count, ttl seconds
-- Reply: {second}
local t = redis.call('TIME')
local key = KEYS[1] .. t[1]
redis.call('INCRBY', key, tonumber(ARGV[1]))
redis.call('EXPIRE', key, tonumber(ARGV[2]))
return cjson.encode({ second = tonumber(t[1]) })
