-- Look a session up for a tenant, reaping it on the spot if it has expired.
-- KEYS: sbs, ses:sid, gone:sid, expiry, tses:tenant, doomed
-- ARGV: sid, tenant (the caller), mode ('touch' counts as activity, 'peek' does not, 'settle'
-- is activity that ends every hold: the one call that held it is over), hold_ms (a touch for a
-- command that may run hold_ms keeps the session busy, not idle, that long),
-- scope ('owner': the caller's own sessions; 'subtree': its descendants' too).
-- Reply (`Lookup`): live {session fields} | gone {reason, at_ms} | missing | node_down
-- A session of a node that is down (its lease expired) is not used: a touch or settle answers
-- node_down at once (before its deadline is checked: its idle clock is not its tenant's fault).
local sid, tenant, mode, scope = ARGV[1], ARGV[2], ARGV[3], ARGV[5]
local h = to_map(redis.call('HGETALL', K.ses(sid)))
if h.tenant == nil then
  local g = to_map(redis.call('HGETALL', K.gone(sid)))
  if owns(tenant, g.tenant, scope) then return reply({ outcome = 'gone', reason = g.reason, at_ms = tonumber(g.at_ms) }) end
  return reply({ outcome = 'missing' })
end
if not owns(tenant, h.tenant, scope) then return reply({ outcome = 'missing' }) end
if mode ~= 'peek' and redis.call('EXISTS', K.lease()) == 0 then return reply({ outcome = 'node_down' }) end
local now = now_ms()
if now >= deadline(h) then
  local reason = 'expired'
  if now >= tonumber(h.hard_ms) then reason = 'max_lifetime' end
  release(sid, h, reason, now)
  return reply({ outcome = 'gone', reason = reason, at_ms = now })
end
if (mode == 'touch' or mode == 'settle') and not paused(h) then
  if mode == 'settle' then
    h.busy_ms = tostring(now)
  else
    h.busy_ms = tostring(math.max(tonumber(h.busy_ms or '0'), now + tonumber(ARGV[4] or '0')))
  end
  h.last_ms = tostring(now)
  redis.call('HSET', K.ses(sid), 'last_ms', h.last_ms, 'busy_ms', h.busy_ms)
  redis.call('ZADD', K.expiry(), deadline(h), sid)
end
local v = session_view(sid, h)
v.outcome = 'live'
return reply(v)
