-- Give up a node that has been down for node_lost_after: its sessions end with reason
-- `node_lost` (their quota leases go to the node's return list, drained by the caller), its
-- idle sandboxes leave the pools and are doomed (a node that comes back destroys them), and
-- its lease stays vacant. Bounded: call again while `more` is true. Refuses a node whose lease
-- exists (it came back meanwhile).
-- KEYS: sbs, lease, expiry, doomed
-- ARGV: limit
-- Reply (`NodeLost`): {ended = [Ended...], doomed, more} | live
if redis.call('EXISTS', K.lease()) == 1 then return reply({ outcome = 'live' }) end
local limit = tonumber(ARGV[1])
local now = now_ms()
local ended = {}
for _, sid in ipairs(redis.call('ZRANGE', K.expiry(), 0, limit - 1)) do
  local h = to_map(redis.call('HGETALL', K.ses(sid)))
  if h.tenant == nil then
    redis.call('ZREM', K.expiry(), sid)
  else
    ended[#ended + 1] = release(sid, h, 'node_lost', now)
  end
end
local doomed = 0
local budget = limit - #ended
local cursor = '0'
repeat
  local r = redis.call('SSCAN', K.sbs(), cursor, 'COUNT', 100)
  cursor = r[1]
  for _, sb in ipairs(r[2]) do
    local key = K.sb(sb)
    local st = redis.call('HGET', key, 'state')
    if (st == 'idle' or st == 'creating') and budget > 0 then
      redis.call('HSET', key, 'state', 'stopping')
      redis.call('LPUSH', K.doomed(), sb)
      local t = redis.call('HGET', key, 'template')
      if t then redis.call('LREM', K.idle(t), 0, sb) end
      doomed = doomed + 1
      budget = budget - 1
    end
  end
until cursor == '0' or budget <= 0
local more = #ended >= limit or budget <= 0
return reply({ outcome = 'given_up', ended = ended, doomed = doomed, more = more })
