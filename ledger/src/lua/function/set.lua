-- Stores a definition (ARGV[2], JSON without version or times): the version is one more than
-- the stored one's. The old definition's idle environments are retired (their sessions are
-- answered for the caller to end); busy ones are retired when their invocation returns them.
local now = now_ms()
local d = cjson.decode(ARGV[2])
local old = redis.call('HGET', def_key, fid)
if old then
  local o = cjson.decode(old)
  d.version = tonumber(o.version) + 1
  d.created_ms = o.created_ms
else
  d.version = 1
  d.created_ms = now
end
d.updated_ms = now
local stored = cjson.encode(d)
redis.call('HSET', def_key, fid, stored)
return cjson.encode({def = stored, retire = drain_idle()})
