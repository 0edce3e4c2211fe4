-- Prepended to every function script. KEYS are one function's, all under its owner's
-- top-level tag `{f:<top>}` (one Redis Cluster slot): 1 def (hash of every definition of the
-- top), 2 idle (list), 3 envs (zset), 4 infl (zset), 5 stat (hash). ARGV[1] is the
-- function's id, `owner|name`, its field in `def`.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local def_key, idle_key, envs_key, infl_key, stat_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local fid = ARGV[1]

-- The sessions of the idle environments, and the list emptied (they are retired).
local function drain_idle()
  local out = {}
  for _, e in ipairs(redis.call('LRANGE', idle_key, 0, -1)) do
    local s = cjson.decode(e).s
    out[#out + 1] = s
    redis.call('ZREM', envs_key, s)
  end
  redis.call('DEL', idle_key)
  return out
end
