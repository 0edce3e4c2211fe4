-- Pause or resume a session's lease bookkeeping (the node freezes/thaws the container).
-- Paused time does not count against the idle timeout; the maximum lifetime still runs.
-- ARGV: base, sid, tenant, 'pause' | 'resume'. Returns {'ok', sandbox, changed} | {'missing'}.
local sid, tenant, op = ARGV[2], ARGV[3], ARGV[4]
local key = base .. 'ses:' .. sid
local h = to_map(redis.call('HGETALL', key))
if h.tenant == nil or h.tenant ~= tenant then return {'missing'} end
local now = now_ms()
local paused = h.paused_ms ~= nil and h.paused_ms ~= '0'
local changed = 0
if op == 'pause' and not paused then
  redis.call('HSET', key, 'paused_ms', now)
  h.paused_ms = tostring(now)
  changed = 1
elseif op == 'resume' and paused then
  redis.call('HSET', key, 'paused_ms', 0, 'last_ms', now)
  h.paused_ms, h.last_ms = '0', tostring(now)
  changed = 1
end
redis.call('ZADD', base .. 'expiry', deadline(h), sid)
return {'ok', h.sandbox, tostring(changed)}
