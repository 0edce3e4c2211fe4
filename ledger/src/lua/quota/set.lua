-- Set (or with an empty limits argument, remove) the limits of a path. A limit may not exceed
-- the one of any ancestor (the top-level tenant's including the defaults).
-- ARGV: path, limits JSON or '', defaults (JSON limits)
-- The isolation classes of a path must lie within every ancestor's list.
-- Reply: {outcome = 'ok'} | {outcome = 'above', dimension, path, limit}
--        | {outcome = 'outside', path, allowed} (an isolation class an ancestor does not allow)
local path, raw, defaults = ARGV[1], ARGV[2], cjson.decode(ARGV[3])
if raw == '' then
  redis.call('HDEL', LIM, path)
  return cjson.encode({ outcome = 'ok' })
end
local new = cjson.decode(raw)
local levels = chain(path)
local top = levels[#levels]
for i = 2, #levels do
  local lim = limits(levels[i], top, defaults)
  if new.isolation ~= nil and lim.isolation ~= nil then
    for _, class in ipairs(new.isolation) do
      if not contains(lim.isolation, class) then
        return cjson.encode({ outcome = 'outside', path = levels[i], allowed = lim.isolation })
      end
    end
  end
  for k, v in pairs(new) do
    if k ~= 'create_burst' and k ~= 'isolation' and lim[k] ~= nil and v > lim[k] then
      return cjson.encode({ outcome = 'above', dimension = k, path = levels[i], limit = lim[k] })
    end
  end
end
redis.call('HSET', LIM, path, raw)
return cjson.encode({ outcome = 'ok' })
