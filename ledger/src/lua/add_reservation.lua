-- Record a declared burst and drop the reservations whose hold has ended (not a node script).
-- KEYS: reservations
-- ARGV: id, reservation JSON
-- Reply: {pruned}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local all = redis.call('HGETALL', KEYS[1])
local pruned = 0
for i = 1, #all, 2 do
  local r = cjson.decode(all[i + 1])
  if r.ready_by_ms + r.hold_s * 1000 < now then
    redis.call('HDEL', KEYS[1], all[i])
    pruned = pruned + 1
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return cjson.encode({ pruned = pruned })
