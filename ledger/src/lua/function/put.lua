-- An invocation ends: its slot is freed, its time counted, and its environment (session
-- ARGV[3], having served ARGV[4] invocations, of version ARGV[5]; its sandbox ARGV[8] and
-- fence ARGV[9]) goes back to the idle list
-- if ARGV[6] is '1', the function still exists at that version and the environment has
-- invocations left. Otherwise it is retired: the answer says so, and the caller ends it.
local now = now_ms()
redis.call('ZREM', infl_key, ARGV[2])
local raw = redis.call('HGET', def_key, fid)
-- ARGV[7] '-': an environment the keeper made, no invocation to count.
if raw and ARGV[7] ~= '-' then
  redis.call('HINCRBY', stat_key, 'done', 1)
  redis.call('HINCRBYFLOAT', stat_key, 'busy_ms', ARGV[7])
end
local keep = ARGV[6] == '1' and raw
if keep then
  local d = cjson.decode(raw)
  keep = tonumber(d.version) == tonumber(ARGV[5]) and tonumber(ARGV[4]) < tonumber(d.max_env_invocations)
  -- Never more environments than invocations may run at once (cold starts and the keeper can
  -- race past it for a moment; the extra one is retired here).
  if keep and not redis.call('ZSCORE', envs_key, ARGV[3])
      and redis.call('ZCARD', envs_key) >= tonumber(d.max_concurrency) then
    keep = false
  end
end
if keep then
  redis.call('LPUSH', idle_key, cjson.encode({s = ARGV[3], v = tonumber(ARGV[5]), n = tonumber(ARGV[4]), t = now,
    b = ARGV[8], f = tonumber(ARGV[9])}))
  redis.call('ZADD', envs_key, now, ARGV[3])
  return cjson.encode({kept = true})
end
redis.call('ZREM', envs_key, ARGV[3])
return cjson.encode({kept = false})
