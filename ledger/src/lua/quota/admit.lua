-- Admit a request against every level of its principal's path, and hold what it costs.
-- ARGV: lease id, path, cost (JSON: stored dimension -> amount), defaults (JSON limits),
--       rate ('1': counts as a session create against create_rate), deadline_in_ms (a
--       session lease without a live session after this long is an orphan), ends_in_ms (0, or
--       when the lease ends by itself, from now), isolation ('' or the isolation class the
--       request uses: refused where a level's `isolation` list leaves it out), checked ('1':
--       the lease ends with a holder, so the sweep looks for it from its deadline on: `qdue`).
-- Reply (`Admission`): {outcome = 'admitted'} | {outcome = 'denied', dimension, path, limit, used, retry_ms}
--        | {outcome = 'forbidden', path, isolation, allowed}
local id, path = ARGV[1], ARGV[2]
local cost, defaults = cjson.decode(ARGV[3]), cjson.decode(ARGV[4])
local rate, deadline_in, ends_in = ARGV[5] == '1', tonumber(ARGV[6]), tonumber(ARGV[7])
local isolation = ARGV[8] or ''
local checked = ARGV[9] == '1'
if redis.call('HEXISTS', LEASE, id) == 1 then return cjson.encode({ outcome = 'admitted' }) end
local now = now_ms()
expire_due(now)
local levels = chain(path)
local top = levels[#levels]
local tats = {}
for _, p in ipairs(levels) do
  local lim = limits(p, top, defaults)
  if isolation ~= '' and lim.isolation ~= nil and not contains(lim.isolation, isolation) then
    return cjson.encode({ outcome = 'forbidden', path = p, isolation = isolation, allowed = lim.isolation })
  end
  local refusal = over_limit(p, lim, cost)
  if refusal then return cjson.encode(refusal) end
  if rate and lim.create_rate ~= nil then
    -- GCRA: one create every `t` ms, `burst` at once.
    local t = 1000 / lim.create_rate
    local burst = lim.create_burst or math.max(1, math.ceil(lim.create_rate))
    local tat = math.max(tonumber(redis.call('HGET', TAT, p) or '0'), now)
    local ahead = tat + t - now - burst * t
    if ahead > 0 then
      local d = denied('create_rate', p, lim.create_rate, burst)
      d.retry_ms = math.ceil(ahead)
      return cjson.encode(d)
    end
    tats[p] = tat + t
  end
end
for _, p in ipairs(levels) do
  for dim, n in pairs(cost) do add(p, dim, n) end
  if tats[p] then redis.call('HSET', TAT, p, tostring(tats[p])) end
end
redis.call('HSET', LEASE, id, cjson.encode({ path = path, cost = cost, queued = 0, at_ms = now, deadline_ms = now + deadline_in }))
if ends_in > 0 then redis.call('ZADD', REXP, now + ends_in, id) end
if checked then redis.call('ZADD', DUE, now + deadline_in, id) end
return cjson.encode({ outcome = 'admitted' })
