-- Check a warm sandbox out for a new session, or (when none is idle and queueing is allowed)
-- queue the request for the next sandbox of this template that becomes ready.
-- ARGV: base, sid, tenant, template, ttl_ms, idle_ms, labels_json, session_key, node,
--       request id, wake channel, max queue length (0: do not queue), waiter ttl ms
-- Returns {'granted', sandbox, fence, now_ms} | {'queued', depth} | {'empty'}
--       | {'full', depth} | {'unhealthy', cause, until_ms}
local s = spec_from_argv()
local now = now_ms()
local sb = pop_idle(s.template)
if sb then
  local fence = lease(sb, s, now)
  return {'granted', sb, tostring(fence), tostring(now)}
end
local max_len = tonumber(ARGV[12])
if max_len == 0 then return {'empty'} end
local health = to_map(redis.call('HGETALL', base .. 'health:' .. s.template))
if health.until_ms and tonumber(health.until_ms) > now then
  return {'unhealthy', health.cause, health.until_ms}
end
local wcount = base .. 'wcount:' .. s.template
local depth = tonumber(redis.call('GET', wcount) or '0')
if depth >= max_len then return {'full', tostring(depth)} end
local req = ARGV[10]
local wkey = base .. 'waiter:' .. req
redis.call('HSET', wkey, 'sid', s.sid, 'tenant', s.tenant, 'template', s.template, 'ttl_ms', s.ttl_ms,
  'idle_ms', s.idle_ms, 'labels', s.labels, 'key', s.key, 'node', s.node, 'channel', ARGV[11])
redis.call('PEXPIRE', wkey, tonumber(ARGV[13]))
local tq = base .. 'wq:' .. s.template .. ':' .. s.tenant
if redis.call('RPUSH', tq, req) == 1 then redis.call('RPUSH', base .. 'wring:' .. s.template, s.tenant) end
redis.call('PEXPIRE', tq, tonumber(ARGV[13]))
return {'queued', tostring(redis.call('INCR', wcount))}
