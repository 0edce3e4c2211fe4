-- Check a warm sandbox out for a new session, or (when none is idle and queueing is allowed)
-- queue the request for the next sandbox of this template that becomes ready.
-- KEYS: sbs, idle:t, fence, ses:sid, expiry, tses:tenant, health:t, wcount:t, wring:t,
--       wq:t:tenant, waiter:request, active, lease, room
-- ARGV: sid, tenant, template, ttl_ms, idle_ms, labels_json, session_key, node,
--       request id, wake channel, max queue length (-1: do not queue; 0: the queue is full),
--       waiter ttl ms
-- Reply (`Checkout`): granted {sandbox_id, fence, now_ms, expires_ms, hard_ms} | queued {depth}
--       | empty (no queue asked for) | full {depth} | unhealthy {cause, until_ms, code?} | down | refused {room, depth}
-- A node whose lease has expired (no heartbeat for node_down_after) is down: nothing is placed
-- on it, warm or queued. A node that reported no room for more sandboxes than already wait
-- for this template refuses to queue (node-side admission): the gateway tries its next choice.
local s = { sid = ARGV[1], tenant = ARGV[2], template = ARGV[3], ttl_ms = ARGV[4], idle_ms = ARGV[5],
            labels = ARGV[6], key = ARGV[7], node = ARGV[8] }
if redis.call('EXISTS', K.lease()) == 0 then return reply({ outcome = 'down' }) end
local now = now_ms()
local sb = pop_idle(s.template)
if sb then
  local g = lease(sb, s, now)
  g.outcome = 'granted'
  return reply(g)
end
local max_len = tonumber(ARGV[11])
if max_len < 0 then return reply({ outcome = 'empty' }) end
local health = to_map(redis.call('HGETALL', K.health(s.template)))
if health.until_ms and tonumber(health.until_ms) > now then
  local code = health.code ~= '' and health.code or nil
  return reply({ outcome = 'unhealthy', cause = health.cause, until_ms = tonumber(health.until_ms), code = code })
end
local wcount = K.wcount(s.template)
local depth = tonumber(redis.call('GET', wcount) or '0')
if depth >= max_len then return reply({ outcome = 'full', depth = depth }) end
local room = redis.call('GET', K.room())
if room and tonumber(room) <= depth then return reply({ outcome = 'refused', room = tonumber(room), depth = depth }) end
local req = ARGV[9]
local waiter_ttl = tonumber(ARGV[12])
local wkey = K.waiter(req)
redis.call('HSET', wkey, 'sid', s.sid, 'tenant', s.tenant, 'template', s.template, 'ttl_ms', s.ttl_ms,
  'idle_ms', s.idle_ms, 'labels', s.labels, 'key', s.key, 'node', s.node, 'channel', ARGV[10])
redis.call('PEXPIRE', wkey, waiter_ttl)
local tq = K.wq(s.template, s.tenant)
if redis.call('RPUSH', tq, req) == 1 then redis.call('RPUSH', K.wring(s.template), s.tenant) end
redis.call('PEXPIRE', tq, waiter_ttl)
return reply({ outcome = 'queued', depth = redis.call('INCR', wcount) })
