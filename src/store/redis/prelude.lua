-- fleetlimit: shared helpers for every algorithm. Numbers are doubles: every value a quota
-- allows stays below 2^53, where integer arithmetic, floor(a / b) and ceil(a / b) are exact.

-- A script that reads TIME and then writes needs its effects replicated: the default since
-- Redis 5.0, but 5.0 to 6.2 can be configured otherwise (`lua-replicate-commands no`), which
-- would refuse every write here. Asked for explicitly (a no-op from Redis 7.0 on).
redis.replicate_commands()

local function ceil_div(a, b)
  return math.ceil(a / b)
end

-- Numbers are written as integers, never in Lua's default "%.14g" (which would round them).
local function int(n)
  return string.format('%d', n)
end

-- Keep `key` until `expires_at` (µs, on the script's clock), or drop it when that has passed.
local function expire_at(key, expires_at, now)
  if expires_at > now then
    redis.call('PEXPIRE', key, ceil_div(expires_at - now, 1000))
  else
    redis.call('DEL', key)
  end
end

local function hash_numbers(key, fields)
  local values = redis.call('HMGET', key, unpack(fields))
  local out = {}
  for i = 1, #fields do
    out[i] = tonumber(values[i])
  end
  return out
end

-- A quantity used, read in another scale, never less than it was: src/algorithm/mod.rs
-- rescale_ceil.
local RESCALE_CAP = 4503599627370496 -- 2^52
local function rescale_ceil(value, from, to)
  if value == 0 or from == 0 or from == to then return value end
  return math.min(math.ceil(value * to / from) + 1, RESCALE_CAP)
end
