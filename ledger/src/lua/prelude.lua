-- Shared helpers, prepended to every script (sandpool ledger).
-- ARGV[1] is always the node's key base "<prefix>:{<node>}:"; every key a script touches
-- starts with it, so a script's keys share one hash tag (one Redis Cluster slot).
local base = ARGV[1]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function to_map(flat)
  local h = {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  return h
end

-- End a session: forget it, doom its sandbox (never reused), leave a tombstone saying why.
local function release(sid, h, reason, now)
  redis.call('DEL', base .. 'ses:' .. sid)
  redis.call('ZREM', base .. 'expiry', sid)
  redis.call('SREM', base .. 'tses:' .. h.tenant, sid)
  local sbkey = base .. 'sb:' .. h.sandbox
  if redis.call('EXISTS', sbkey) == 1 then
    redis.call('HSET', sbkey, 'state', 'stopping')
    redis.call('LPUSH', base .. 'doomed', h.sandbox)
  end
  local gone = base .. 'gone:' .. sid
  redis.call('HSET', gone, 'tenant', h.tenant, 'reason', reason, 'at_ms', now)
  redis.call('PEXPIRE', gone, 3600000)
end

-- The session fields of a grant or a waiter, from ARGV[2..9]:
-- sid, tenant, template, ttl_ms, idle_ms, labels_json, session_key, node.
local function spec_from_argv()
  return { sid = ARGV[2], tenant = ARGV[3], template = ARGV[4], ttl_ms = ARGV[5], idle_ms = ARGV[6],
           labels = ARGV[7], key = ARGV[8], node = ARGV[9] }
end

-- When a session ends unless used: its idle deadline (not while paused), capped by the hard one.
local function deadline(h)
  local hard = tonumber(h.hard_ms)
  if h.paused_ms and h.paused_ms ~= '' and h.paused_ms ~= '0' then return hard end
  return math.min(math.max(tonumber(h.last_ms), tonumber(h.busy_ms or '0')) + tonumber(h.idle_ms), hard)
end

-- Pop an idle sandbox of `template`, skipping entries whose sandbox left the idle state
-- behind the list's back (bounded). nil when the pool is empty.
local function pop_idle(template)
  local idle_key = base .. 'idle:' .. template
  for _ = 1, 64 do
    local cand = redis.call('RPOP', idle_key)
    if not cand then return nil end
    if redis.call('HGET', base .. 'sb:' .. cand, 'state') == 'idle' then return cand end
  end
  return nil
end

-- Lease sandbox `sb` to the new session `s`: session record, deadlines, and a fencing token
-- that grows on every grant. Returns the fence.
local function lease(sb, s, now)
  local fence = redis.call('INCR', base .. 'fence')
  local idle, hard = tonumber(s.idle_ms), now + tonumber(s.ttl_ms)
  redis.call('HSET', base .. 'sb:' .. sb, 'state', 'leased', 'session', s.sid, 'fence', fence, 'leased_ms', now)
  redis.call('HSET', base .. 'ses:' .. s.sid,
    'tenant', s.tenant, 'sandbox', sb, 'template', s.template, 'node', s.node, 'fence', fence,
    'created_ms', now, 'last_ms', now, 'idle_ms', idle, 'hard_ms', hard,
    'labels', s.labels, 'key', s.key)
  redis.call('ZADD', base .. 'expiry', math.min(now + idle, hard), s.sid)
  redis.call('SADD', base .. 'tses:' .. s.tenant, s.sid)
  return fence
end

-- Take the next waiting request of `template`, round-robin over tenants, FIFO within one.
-- Returns its id and fields (fields nil if the waiter vanished), or nil when none waits.
local function next_waiter(template)
  local ring = base .. 'wring:' .. template
  local tenant = redis.call('LPOP', ring)
  if not tenant then return nil end
  local tq = base .. 'wq:' .. template .. ':' .. tenant
  local req = redis.call('LPOP', tq)
  if redis.call('LLEN', tq) > 0 then redis.call('RPUSH', ring, tenant) end
  if redis.call('DECR', base .. 'wcount:' .. template) < 0 then redis.call('SET', base .. 'wcount:' .. template, 0) end
  if not req then return '', nil end
  local wkey = base .. 'waiter:' .. req
  local w = to_map(redis.call('HGETALL', wkey))
  redis.call('DEL', wkey)
  if not w.sid then return req, nil end
  return req, w
end

-- Leave `message` in a waiter's mailbox and wake its gateway.
local function deliver(req, channel, message)
  redis.call('SET', base .. 'mail:' .. req, message, 'PX', 120000)
  redis.call('PUBLISH', channel, req)
end

-- Hand a ready sandbox to the longest-waiting request. True if a waiter took it.
local function grant_waiter(sb, template, now)
  for _ = 1, 64 do
    local req, w = next_waiter(template)
    if req == nil then return false end
    if w then
      local fence = lease(sb, w, now)
      deliver(req, w.channel, 'ok ' .. sb .. ' ' .. fence .. ' ' .. now)
      return true
    end
  end
  return false
end
