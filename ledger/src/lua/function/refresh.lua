-- The keeper keeps up to ARGV[2] idle environments of the current version warm: their idle
-- clocks restart now (the caller settles their sessions too), and their sessions are answered.
-- Entries of an older version or idle too long are dropped and answered as stale.
local now = now_ms()
local raw = redis.call('HGET', def_key, fid)
if not raw then return cjson.encode({keep = {}, stale = {}}) end
local d = cjson.decode(raw)
local idle_ms = tonumber(d.env_idle_s) * 1000
local keep, stale = {}, {}
local entries = redis.call('LRANGE', idle_key, 0, -1)
redis.call('DEL', idle_key)
for _, e in ipairs(entries) do
  local env = cjson.decode(e)
  if tonumber(env.v) ~= tonumber(d.version) or now - tonumber(env.t) >= idle_ms then
    stale[#stale + 1] = env.s
    redis.call('ZREM', envs_key, env.s)
  else
    if #keep < tonumber(ARGV[2]) then
      env.t = now
      keep[#keep + 1] = env.s
      redis.call('ZADD', envs_key, now, env.s)
    end
    redis.call('RPUSH', idle_key, cjson.encode(env))
  end
end
return cjson.encode({keep = keep, stale = stale})
