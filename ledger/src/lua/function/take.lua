-- An invocation starts: within the function's concurrency it gets a slot (ARGV[2], the
-- invocation id, until its timeout and ARGV[3] ms more have passed) and the warmest idle environment of the current
-- version, if any. Environments of an older version, and those idle past the function's
-- `env_idle_s` (their sessions have ended or are about to), are answered as stale.
local now = now_ms()
local raw = redis.call('HGET', def_key, fid)
if not raw then return cjson.encode({outcome = 'missing'}) end
local d = cjson.decode(raw)
redis.call('ZREMRANGEBYSCORE', infl_key, '-inf', now)
-- A retry of the same invocation (its environment was gone) keeps its slot.
if not redis.call('ZSCORE', infl_key, ARGV[2]) then
  if redis.call('ZCARD', infl_key) >= tonumber(d.max_concurrency) then
    return cjson.encode({outcome = 'busy', def = raw})
  end
end
redis.call('ZADD', infl_key, now + tonumber(d.timeout_ms) + tonumber(ARGV[3]), ARGV[2])
local stale = {}
local idle_ms = tonumber(d.env_idle_s) * 1000
while #stale < 32 do
  local e = redis.call('LPOP', idle_key)
  if not e then break end
  local env = cjson.decode(e)
  if tonumber(env.v) == tonumber(d.version) and now - tonumber(env.t) < idle_ms then
    env.a = now - tonumber(env.t)
    return cjson.encode({outcome = 'taken', def = raw, env = env, stale = stale})
  end
  stale[#stale + 1] = env.s
  redis.call('ZREM', envs_key, env.s)
end
return cjson.encode({outcome = 'taken', def = raw, stale = stale})
