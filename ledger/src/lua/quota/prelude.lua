-- Shared helpers of the quota scripts. KEYS are always one top-level tenant's quota scope, in
-- this order: qlim, quse, qtat, qlease, qrexp, qadm, qdue (ledger/src/keys.rs), all under one hash tag, so
-- every level of a principal's path is checked and changed in one atomic step.
--
-- Usage is kept in integers per path and dimension: sessions, cpu_m (milli-cpus), memory_mb,
-- queued, reserved, ptpl (private templates), ptpl_mb (their disk, MiB), fn (functions), ainf
-- and ares (asynchronous invocations in flight and kept; ares_kb: the kept ones' KiB), resv and ritems (live reservations and
-- the templates they name). A lease says what one request, session, reservation, private
-- template, function or asynchronous invocation holds; giving it back is idempotent (HDEL says whether it
-- was still held), so every ending may give back more than once without drift.

local LIM, USE, TAT, LEASE, REXP, ADM, DUE = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A path and its ancestors, the path itself first, the top-level tenant last.
local function chain(path)
  local out = { path }
  local p = path
  while true do
    local cut = string.match(p, '^.*()/')
    if not cut then break end
    p = string.sub(p, 1, cut - 1)
    out[#out + 1] = p
  end
  return out
end

-- Stored dimension -> the limit's (and the API's) name.
local PUBLIC = {
  sessions = 'sessions', cpu_m = 'cpus', memory_mb = 'memory_mb', queued = 'queued',
  reserved = 'reserved', ptpl = 'private_templates', ptpl_mb = 'private_template_mb',
  fn = 'functions', ainf = 'async_in_flight', ares = 'async_results', ares_kb = 'async_result_mb',
  resv = 'reservations',
  ritems = 'reservation_items',
}

-- The limits binding `path`: its own, and for the top-level tenant the default for every
-- dimension it does not set itself.
local function limits(path, top, defaults)
  local raw = redis.call('HGET', LIM, path)
  local lim = {}
  if raw then lim = cjson.decode(raw) end
  if path == top then
    for k, v in pairs(defaults) do
      if lim[k] == nil then lim[k] = v end
    end
  end
  return lim
end

-- The limit of a stored dimension, in stored units (nil: none).
local function limit_of(lim, dim)
  local v = lim[PUBLIC[dim]]
  if v == nil then return nil end
  if dim == 'cpu_m' then return v * 1000 end
  if dim == 'ares_kb' then return v * 1024 end
  return v
end

local function contains(list, item)
  for _, x in ipairs(list) do
    if x == item then return true end
  end
  return false
end

local function used(path, dim)
  return tonumber(redis.call('HGET', USE, path .. '|' .. dim) or '0')
end

local function add(path, dim, n)
  if n == 0 then return end
  if redis.call('HINCRBY', USE, path .. '|' .. dim, n) <= 0 then redis.call('HDEL', USE, path .. '|' .. dim) end
end

-- The refusal for one dimension at one level (limit and used in the API's units).
local function denied(dim, path, limit, in_use)
  if dim == 'cpu_m' then limit, in_use = limit / 1000, in_use / 1000 end
  if dim == 'ares_kb' then limit, in_use = limit / 1024, in_use / 1024 end
  return { outcome = 'denied', dimension = PUBLIC[dim] or dim, path = path, limit = limit, used = in_use, retry_ms = 0 }
end

-- The refusal for the first dimension of `cost` (stored dimension -> amount) that would take
-- level `p` (with limits `lim`) over its limit; nil when all of it fits.
local function over_limit(p, lim, cost)
  for dim, n in pairs(cost) do
    local limit = limit_of(lim, dim)
    if n > 0 and limit ~= nil then
      local u = used(p, dim)
      if u + n > limit then return denied(dim, p, limit, u) end
    end
  end
  return nil
end

-- Gives a lease back at every level of its path. True if it was still held.
local function give_back(id)
  local raw = redis.call('HGET', LEASE, id)
  if not raw then return false end
  local l = cjson.decode(raw)
  for _, p in ipairs(chain(l.path)) do
    for dim, n in pairs(l.cost) do add(p, dim, -n) end
    if l.queued == 1 then add(p, 'queued', -1) end
  end
  redis.call('HDEL', LEASE, id)
  redis.call('ZREM', REXP, id)
  redis.call('ZREM', DUE, id)
  return true
end

-- Gives back the leases that end by themselves (reservations past their hold).
local function expire_due(now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', REXP, '-inf', now, 'LIMIT', 0, 64)) do give_back(id) end
end
