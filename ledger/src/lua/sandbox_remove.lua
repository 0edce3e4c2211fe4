-- Forget a sandbox (its container is gone or going). A session on it ends with `reason`.
-- KEYS: sbs, sb:sandbox, expiry, doomed
-- ARGV: sandbox, reason
-- Reply (`Removed`): {ended = Ended | absent}
local sb, reason = ARGV[1], ARGV[2]
local key = K.sb(sb)
local h = to_map(redis.call('HGETALL', key))
if h.template then redis.call('LREM', K.idle(h.template), 0, sb) end
redis.call('SREM', K.sbs(), sb)
redis.call('DEL', key)
if h.session then
  local s = to_map(redis.call('HGETALL', K.ses(h.session)))
  if s.tenant then return reply({ ended = release(h.session, s, reason, now_ms()) }) end
end
return reply({})
