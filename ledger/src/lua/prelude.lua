-- Shared helpers, prepended to every node script after the generated key functions
-- (`base` and `K.*`, from ledger/src/keys.rs). KEYS[1] is always the node's `sbs` key, so every
-- key a script touches shares the node's hash tag (one Redis Cluster slot). Keys a script only
-- discovers while it runs (a sandbox popped from a pool, the next waiter of a ring) are built
-- with `K.*` under that same tag. Every script answers one JSON document (`reply`), which the
-- Rust side decodes into a typed value.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function to_map(flat)
  local h = {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  return h
end

local function reply(t)
  return cjson.encode(t)
end

-- Whether principal `caller` may act on what `owner` owns: its own, and with scope 'subtree'
-- also its descendants' (`acme` manages `acme/rl`, never `acme-2`).
local function owns(caller, owner, scope)
  if owner == caller then return true end
  return scope == 'subtree' and owner ~= nil and string.sub(owner, 1, #caller + 1) == caller .. '/'
end

local function paused(h)
  return h.paused_ms ~= nil and h.paused_ms ~= '' and h.paused_ms ~= '0'
end

-- THE session deadline (the one place it is computed): when a session ends unless used: its
-- idle deadline (never while paused, and not before a running call's hold ends), capped by
-- its maximum lifetime.
local function deadline(h)
  local hard = tonumber(h.hard_ms)
  if paused(h) then return hard end
  return math.min(math.max(tonumber(h.last_ms), tonumber(h.busy_ms or '0')) + tonumber(h.idle_ms), hard)
end

-- A stored session as the Rust `SessionRecord` reads it.
local function session_view(sid, h)
  local labels = {}
  if h.labels and h.labels ~= '' then labels = cjson.decode(h.labels) end
  local key = nil
  if h.key and h.key ~= '' then key = h.key end
  local paused_ms = nil
  if paused(h) then paused_ms = tonumber(h.paused_ms) end
  -- The sandbox's egress policy, as its node enforces it (same hash tag as the session).
  local egress = redis.call('HGET', K.sb(h.sandbox), 'egress')
  if not egress or egress == '' then egress = nil end
  return {
    id = sid, tenant = h.tenant, node = h.node, sandbox = h.sandbox, template = h.template,
    fence = tonumber(h.fence), created_ms = tonumber(h.created_ms), last_ms = tonumber(h.last_ms),
    idle_ms = tonumber(h.idle_ms), hard_ms = tonumber(h.hard_ms), busy_ms = tonumber(h.busy_ms or '0'),
    paused_ms = paused_ms, expires_ms = deadline(h), labels = labels, session_key = key, egress = egress,
  }
end

-- End a session: forget it, doom its sandbox (never reused), leave a tombstone saying why.
-- Returns what the Rust `Ended` reads.
local function release(sid, h, reason, now)
  redis.call('DEL', K.ses(sid))
  redis.call('ZREM', K.expiry(), sid)
  redis.call('SREM', K.tses(h.tenant), sid)
  -- Live sessions per tenant (the sessions-active gauge); a field at zero is removed.
  if redis.call('HINCRBY', K.active(), h.tenant, -1) <= 0 then redis.call('HDEL', K.active(), h.tenant) end
  -- Its quota lease is given back by whoever drains this list (idempotently).
  redis.call('LPUSH', K.qret(), h.tenant .. '\t' .. sid)
  local sbkey = K.sb(h.sandbox)
  if redis.call('EXISTS', sbkey) == 1 then
    redis.call('HSET', sbkey, 'state', 'stopping')
    redis.call('LPUSH', K.doomed(), h.sandbox)
  end
  local gone = K.gone(sid)
  redis.call('HSET', gone, 'tenant', h.tenant, 'reason', reason, 'at_ms', now)
  redis.call('PEXPIRE', gone, 3600000)
  local key = nil
  if h.key and h.key ~= '' then key = h.key end
  return { session_id = sid, tenant = h.tenant, session_key = key, reason = reason, sandbox = h.sandbox }
end

-- Pop an idle sandbox of `template`, skipping entries whose sandbox left the idle state
-- behind the list's back (bounded). nil when the pool is empty.
local function pop_idle(template)
  local idle_key = K.idle(template)
  for _ = 1, 64 do
    local cand = redis.call('RPOP', idle_key)
    if not cand then return nil end
    if redis.call('HGET', K.sb(cand), 'state') == 'idle' then return cand end
  end
  return nil
end

-- Lease sandbox `sb` to the new session `s` (fields of a lease spec: sid, tenant, template,
-- ttl_ms, idle_ms, labels, key, node): session record, deadlines, and a fencing token that
-- grows on every grant. Returns the grant as the Rust `Grant` reads it.
local function lease(sb, s, now)
  local fence = redis.call('INCR', K.fence())
  local h = {
    tenant = s.tenant, sandbox = sb, template = s.template, node = s.node, fence = fence,
    created_ms = now, last_ms = now, idle_ms = tonumber(s.idle_ms), hard_ms = now + tonumber(s.ttl_ms),
    labels = s.labels, key = s.key,
  }
  redis.call('HSET', K.sb(sb), 'state', 'leased', 'session', s.sid, 'fence', fence, 'leased_ms', now)
  redis.call('HSET', K.ses(s.sid),
    'tenant', h.tenant, 'sandbox', sb, 'template', h.template, 'node', h.node, 'fence', fence,
    'created_ms', now, 'last_ms', now, 'idle_ms', h.idle_ms, 'hard_ms', h.hard_ms,
    'labels', h.labels, 'key', h.key)
  local expires = deadline(h)
  redis.call('ZADD', K.expiry(), expires, s.sid)
  redis.call('SADD', K.tses(s.tenant), s.sid)
  redis.call('HINCRBY', K.active(), s.tenant, 1)
  return { sandbox_id = sb, fence = fence, now_ms = now, expires_ms = expires, hard_ms = h.hard_ms }
end

-- Take the next waiting request of `template`, round-robin over tenants, FIFO within one.
-- Returns its id and fields (fields nil if the waiter vanished), or nil when none waits.
local function next_waiter(template)
  local ring = K.wring(template)
  local tenant = redis.call('LPOP', ring)
  if not tenant then return nil end
  local tq = K.wq(template, tenant)
  local req = redis.call('LPOP', tq)
  if redis.call('LLEN', tq) > 0 then redis.call('RPUSH', ring, tenant) end
  -- The tenant's list expired behind the ring's back: nothing was counted off (the reaper's
  -- recount, `recount.lua`, puts wcount right).
  if not req then return '', nil end
  if redis.call('DECR', K.wcount(template)) < 0 then redis.call('SET', K.wcount(template), 0) end
  local wkey = K.waiter(req)
  local w = to_map(redis.call('HGETALL', wkey))
  redis.call('DEL', wkey)
  if not w.sid then return req, nil end
  return req, w
end

-- Leave `mail` (a table the Rust `Mail` reads) in a waiter's mailbox and wake its gateway.
local function deliver(req, channel, mail)
  redis.call('SET', K.mail(req), cjson.encode(mail), 'PX', 120000)
  redis.call('PUBLISH', channel, req)
end

-- Hand a ready sandbox to the longest-waiting request. True if a waiter took it. The grant is
-- unclaimed until its waiter collects the mail (`take_mail`, `dequeue`): a waiter whose gateway
-- is gone never does, and past the claim window (CLAIM_WINDOW_MS, from queue.rs) the reaper
-- undoes the grant (`unlease`). The session remembers its mailbox, and the mail its session.
local function grant_waiter(sb, template, now)
  for _ = 1, 64 do
    local req, w = next_waiter(template)
    if req == nil then return false end
    if w then
      local g = lease(sb, w, now)
      redis.call('HSET', K.ses(w.sid), 'mailbox', req)
      redis.call('ZADD', K.unclaimed(), now + CLAIM_WINDOW_MS, w.sid)
      g.outcome = 'granted'
      g.session_id = w.sid
      deliver(req, w.channel, g)
      return true
    end
  end
  return false
end

-- A waiter collected its mail (JSON, or nil): a grant in it is claimed, and the reaper leaves
-- it alone from now on. Returns the mail.
local function claim(mail)
  if mail then
    local sid = cjson.decode(mail).session_id
    if sid then redis.call('ZREM', K.unclaimed(), sid) end
  end
  return mail
end

-- Undo the grant of session `sid` (stored as `h`) that nobody has seen: everything `lease`
-- counted is uncounted, the session is forgotten without a tombstone, its mail (if it was a
-- waiter's grant) is withdrawn, and its sandbox goes to the longest waiter of its template,
-- else back to its pool. Not doomed: no call ever reached it. `give_back`: queue the session's
-- quota lease for return (`qret`), for a grant whose request is gone.
local function unlease(sid, h, now, give_back)
  redis.call('DEL', K.ses(sid))
  redis.call('ZREM', K.expiry(), sid)
  redis.call('ZREM', K.unclaimed(), sid)
  redis.call('SREM', K.tses(h.tenant), sid)
  if redis.call('HINCRBY', K.active(), h.tenant, -1) <= 0 then redis.call('HDEL', K.active(), h.tenant) end
  if h.mailbox and h.mailbox ~= '' then redis.call('DEL', K.mail(h.mailbox)) end
  if give_back then redis.call('LPUSH', K.qret(), h.tenant .. '\t' .. sid) end
  local key = K.sb(h.sandbox)
  if redis.call('HGET', key, 'state') == 'leased' and redis.call('HGET', key, 'session') == sid then
    redis.call('HDEL', key, 'session', 'leased_ms')
    if not grant_waiter(h.sandbox, h.template, now) then
      redis.call('HSET', key, 'state', 'idle')
      redis.call('RPUSH', K.idle(h.template), h.sandbox)
    end
  end
end
