-- Pause or resume a session's lease bookkeeping (the node freezes/thaws the container).
-- Paused time does not count against the idle timeout; the maximum lifetime still runs.
-- KEYS: sbs, ses:sid, expiry
-- ARGV: sid, tenant (the caller: the owner or an ancestor), 'pause' | 'resume'
-- Reply (`Paused`): ok {sandbox, changed} | missing
local sid, tenant, op = ARGV[1], ARGV[2], ARGV[3]
local key = K.ses(sid)
local h = to_map(redis.call('HGETALL', key))
if h.tenant == nil or not owns(tenant, h.tenant, 'subtree') then return reply({ outcome = 'missing' }) end
local now = now_ms()
local changed = false
if op == 'pause' and not paused(h) then
  redis.call('HSET', key, 'paused_ms', now)
  h.paused_ms = tostring(now)
  changed = true
elseif op == 'resume' and paused(h) then
  redis.call('HSET', key, 'paused_ms', 0, 'last_ms', now)
  h.paused_ms, h.last_ms = '0', tostring(now)
  changed = true
end
redis.call('ZADD', K.expiry(), deadline(h), sid)
return reply({ outcome = 'ok', sandbox = h.sandbox, changed = changed })
