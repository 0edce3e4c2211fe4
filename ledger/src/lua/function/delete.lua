-- Deletes a function: every environment it has, idle or busy, is answered for the caller to
-- end (a busy one's invocation finishes, then finds the function gone and cannot return it).
if redis.call('HDEL', def_key, fid) == 0 then
  return cjson.encode({existed = false, retire = {}})
end
local all = redis.call('ZRANGE', envs_key, 0, -1)
redis.call('DEL', idle_key, envs_key, infl_key, stat_key)
return cjson.encode({existed = true, retire = all})
