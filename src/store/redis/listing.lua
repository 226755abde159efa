-- fleetlimit: a key's listing, for every rule of this key prefix: read it, or set it.
--
-- KEYS[1]: the key's listing key ({key}:listing, in the key's slot).
-- ARGV[1]: 'get' | 'allow' | 'deny' | 'block' | 'clear' | 'penalty' (a block unless an
--          allow or deny entry, or a block ending no sooner, is there). A 'block' never
--          replaces a deny entry, and one of length 0 ends a block, nothing else.
-- ARGV[2]: now in µs, or '' to read the server's clock (the one apply.lua reads).
-- ARGV[3]: for 'block' and 'penalty', its length in µs.
-- Stored: 'allow', 'deny', or the block's end in µs (expiring with it).
-- Returns the listing in force after the call: {'none' | 'allow' | 'deny' | 'block', µs left},
-- or {'penalty', µs left} for a penalty this call set.
-- A script that reads TIME and then writes needs its effects replicated: the default since
-- Redis 5.0, but 5.0 to 6.2 can be configured otherwise (`lua-replicate-commands no`), which
-- would refuse every write here. Asked for explicitly (a no-op from Redis 7.0 on).
redis.replicate_commands()

local now = tonumber(ARGV[2])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local op = ARGV[1]
if op == 'penalty' then
  local v = redis.call('GET', KEYS[1])
  if v == 'allow' or v == 'deny' then return { v, 0 } end
  local t = tonumber(v)
  if t ~= nil and t > now and t >= now + tonumber(ARGV[3]) then return { 'block', t - now } end
  local len = tonumber(ARGV[3])
  redis.call('SET', KEYS[1], string.format('%d', now + len), 'PX', math.max(1, math.ceil(len / 1000)))
  return { 'penalty', len }
end
if op == 'allow' or op == 'deny' then
  redis.call('SET', KEYS[1], op)
  return { op, 0 }
elseif op == 'block' then
  local v = redis.call('GET', KEYS[1])
  if v == 'deny' then return { 'deny', 0 } end
  local len = tonumber(ARGV[3])
  if len == 0 then
    if v == 'allow' then return { 'allow', 0 } end
    redis.call('DEL', KEYS[1])
    return { 'none', 0 }
  end
  redis.call('SET', KEYS[1], string.format('%d', now + len), 'PX', math.max(1, math.ceil(len / 1000)))
  return { 'block', len }
elseif op == 'clear' then
  redis.call('DEL', KEYS[1])
  return { 'none', 0 }
end
local v = redis.call('GET', KEYS[1])
if not v then return { 'none', 0 } end
if v == 'allow' or v == 'deny' then return { v, 0 } end
local t = tonumber(v)
if t ~= nil and t > now then return { 'block', t - now } end
return { 'none', 0 }
