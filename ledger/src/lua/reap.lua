-- Reap sessions whose deadline has passed.
-- KEYS: sbs, expiry, doomed
-- ARGV: limit
-- Reply (`Reaped`): {ended = [Ended...]}
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', K.expiry(), '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local ended = {}
for _, sid in ipairs(due) do
  local h = to_map(redis.call('HGETALL', K.ses(sid)))
  if h.tenant == nil then
    redis.call('ZREM', K.expiry(), sid)
  else
    local reason = 'expired'
    if now >= tonumber(h.hard_ms) then reason = 'max_lifetime' end
    ended[#ended + 1] = release(sid, h, reason, now)
  end
end
return reply({ ended = ended })
