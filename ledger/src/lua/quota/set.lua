-- Set (or with an empty limits argument, remove) the limits of a path. A limit may not exceed
-- the one of any ancestor (the top-level tenant's including the defaults).
-- ARGV: path, limits JSON or '', defaults (JSON limits), by_admin ('1': an admin sets them)
-- The isolation classes of a path must lie within every ancestor's list.
-- Who set a limit decides who may change it: an admin's limits are kept in ADM as well as in
-- LIM. A non-admin (an ancestor tenant) may restate them or tighten them (LIM stays within ADM,
-- so admission reads LIM alone), never loosen or remove them; an admin replaces both.
-- Reply: {outcome = 'ok'} | {outcome = 'above', dimension, path, limit}
--        | {outcome = 'outside', path, allowed} (an isolation class an ancestor does not allow)
--        | {outcome = 'admin_set', path, fields} (admin-set limits a non-admin would loosen or remove)
local path, raw, defaults, by_admin = ARGV[1], ARGV[2], cjson.decode(ARGV[3]), ARGV[4] == '1'

-- Fields of the admin-set limits `adm` that `new` (nil: removed) would loosen or drop, sorted.
local function loosened(adm, new)
  local out = {}
  for k, a in pairs(adm) do
    local v = new and new[k]
    local bad
    if k == 'isolation' then
      bad = v == nil
      if not bad then
        for _, class in ipairs(v) do
          if not contains(a, class) then bad = true end
        end
      end
    elseif k == 'create_burst' then
      bad = false -- checked with create_rate below
    else
      bad = v == nil or v > a
    end
    if bad then out[#out + 1] = k end
  end
  -- A burst absent means one second's worth of the rate: compare what each would allow.
  if adm.create_rate ~= nil and new and new.create_rate ~= nil then
    local a = adm.create_burst or math.max(1, math.ceil(adm.create_rate))
    local b = new.create_burst or math.max(1, math.ceil(new.create_rate))
    if b > a then out[#out + 1] = 'create_burst' end
  end
  table.sort(out)
  return out
end

local adm_raw = redis.call('HGET', ADM, path)
if not by_admin and adm_raw then
  local new = nil
  if raw ~= '' then new = cjson.decode(raw) end
  local fields = loosened(cjson.decode(adm_raw), new)
  if #fields > 0 then return cjson.encode({ outcome = 'admin_set', path = path, fields = fields }) end
end
if raw == '' then
  redis.call('HDEL', LIM, path)
  redis.call('HDEL', ADM, path)
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
if by_admin then
  if next(new) == nil then redis.call('HDEL', ADM, path) else redis.call('HSET', ADM, path, raw) end
end
return cjson.encode({ outcome = 'ok' })
