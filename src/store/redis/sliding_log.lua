-- Sliding window log: src/algorithm/sliding_log.rs, line for line.
-- State: LIST of admission times (µs), oldest first; a request of cost c pushes c entries.
local sliding_log = {}

function sliding_log.load(key)
  return { key = key }
end

-- Times never run backwards inside the log: a clock that stepped back reads as the newest entry.
local function effective_now(st, now)
  local last = tonumber(redis.call('LINDEX', st.key, -1))
  if last ~= nil and last > now then return last, last end
  return now, last
end

function sliding_log.decide(st, now, q, cost)
  local period, limit = q.period, q.limit
  local last
  local clock = now
  now, last = effective_now(st, now)
  st.now = now
  -- The waits are the clock's: the log's time plus what a clock stepped back has to catch up.
  local behind = now - clock
  -- The index of the oldest entry still counted.
  local first = 0
  if st.readonly then
    -- A peek or a refund forgets nothing (it may read the log under a quota not the key's
    -- own, a shorter period): the expired entries are skipped, found by halves (it is sorted).
    local lo, hi = 0, redis.call('LLEN', st.key)
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      if tonumber(redis.call('LINDEX', st.key, mid)) + period <= now then lo = mid + 1 else hi = mid end
    end
    first = lo
    if last ~= nil and last + period <= now then last = nil end
  elseif last ~= nil and last + period <= now then
    -- Forget expired entries: all at once when the newest has expired, else from the head.
    redis.call('DEL', st.key)
    last = nil
  else
    while true do
      local head = tonumber(redis.call('LINDEX', st.key, 0))
      if head == nil or head + period > now then break end
      redis.call('LPOP', st.key)
    end
  end
  local count = redis.call('LLEN', st.key) - first
  local remaining = math.max(limit - count, 0)
  local reset_after = 0
  if last ~= nil then reset_after = last + period - now + behind end
  if cost > limit then return { 0, limit, remaining, reset_after, -1 } end
  if count + cost <= limit then
    return { 1, limit, remaining - cost, period + behind, -1 }
  end
  local must_expire = count + cost - limit
  local oldest = tonumber(redis.call('LINDEX', st.key, first + must_expire - 1))
  return { 0, limit, remaining, reset_after, oldest + period - now + behind }
end

function sliding_log.commit(st, now, q, cost)
  local stamp = int(st.now)
  local batch = {}
  for i = 1, math.min(cost, 1000) do batch[i] = stamp end
  local left = cost
  while left > 0 do
    local n = math.min(left, 1000)
    redis.call('RPUSH', st.key, unpack(batch, 1, n))
    left = left - n
  end
  return st.now
end

-- Remove up to `cost` entries of the receipt's timestamp, newest first: never another
-- request's entry. LREM exists in every Redis version.
function sliding_log.refund(st, now, q, at, cost)
  redis.call('LREM', st.key, -cost, int(at))
end

function sliding_log.save(st, now, q)
  -- A refund only removes entries: the log lives no longer than it did (and its quota may
  -- not be the key's own).
  if st.readonly then return end
  local last = tonumber(redis.call('LINDEX', st.key, -1))
  if last == nil then return end
  expire_at(st.key, last + q.period, now)
end
