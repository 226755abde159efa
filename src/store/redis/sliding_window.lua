-- Sliding window counter: src/algorithm/sliding_window.rs, line for line.
-- State: HASH { s = start of the current window, p = previous count, c = current count,
-- w = the period the windows were aligned to, v = receipts from before this time refund nothing }.
local sliding_window = {}

function sliding_window.load(key)
  local v = hash_numbers(key, { 's', 'p', 'c', 'w', 'v' })
  return {
    key = key, start = v[1] or 0, previous = v[2] or 0, current = v[3] or 0, period = v[4] or 0,
    valid_from = v[5] or 0,
  }
end

local function sw_reset_after(st, now, period)
  local empty_from = now
  if st.current > 0 then
    empty_from = st.start + 2 * period
  elseif st.previous > 0 then
    empty_from = st.start + period
  end
  return math.max(empty_from - now, 0)
end

local function sw_retry_at(st, q, cost)
  local period, limit = q.period, q.limit
  local p_ms = period / 1000
  if st.previous > 0 and st.current + cost <= limit then
    local room = (limit - st.current - cost) * p_ms
    local e = math.max(p_ms - math.floor(room / st.previous), 0)
    if e < p_ms then return st.start + e * 1000 end
  end
  local e = 0
  if st.current > 0 then
    e = p_ms - math.min(math.floor((limit - cost) * p_ms / st.current), p_ms)
  end
  return st.start + period + e * 1000
end

function sliding_window.decide(st, now, q, cost)
  local period, limit = q.period, q.limit
  local p_ms = period / 1000
  local window = now - (now % period)
  if st.period ~= period then
    -- A conversion is not a roll forward: it must be kept even by a peek or a denial.
    if st.period ~= 0 then
      st.dirty = true
      st.valid_from = now
    end
    local old = st.period
    local previous, current = 0, 0
    if now < st.start + old then previous = st.previous end
    if now < st.start + 2 * old then current = st.current end
    st.start, st.previous, st.current, st.period = window, 0, previous + current, period
  end
  if window > st.start then
    if window == st.start + period then
      st.previous = st.current
    else
      st.previous = 0
    end
    st.current = 0
    st.start = window
  end
  local elapsed_ms = math.min(math.floor(math.max(now - st.start, 0) / 1000), p_ms)
  local weighted = st.previous * (p_ms - elapsed_ms) + st.current * p_ms
  local capacity = limit * p_ms
  local remaining = math.floor(math.max(capacity - weighted, 0) / p_ms)
  local reset_after = sw_reset_after(st, now, period)
  if cost > limit then return { 0, limit, remaining, reset_after, -1 } end
  if weighted + cost * p_ms <= capacity then
    return { 1, limit, remaining - cost, math.max(st.start + 2 * period - now, 0), -1 }
  end
  return { 0, limit, remaining, reset_after, sw_retry_at(st, q, cost) - now }
end

function sliding_window.taken(st, now, cost)
  local at = math.max(now, st.start)
  if st.valid_from == 0 and cost > 0 then st.valid_from = at end
  return at
end

function sliding_window.commit(st, now, q, cost)
  st.current = st.current + cost
  return sliding_window.taken(st, now, cost)
end

function sliding_window.refund(st, now, q, at, cost)
  if at < st.valid_from or st.period == 0 then return end
  local window = at - (at % st.period)
  if window == st.start then
    st.current = math.max(st.current - cost, 0)
  elseif window + st.period == st.start then
    st.previous = math.max(st.previous - cost, 0)
  end
end

function sliding_window.save(st, now, q)
  local expires_at = 0
  if st.current > 0 then
    expires_at = st.start + 2 * q.period
  elseif st.previous > 0 then
    expires_at = st.start + q.period
  end
  if expires_at > now then
    redis.call('HSET', st.key, 's', int(st.start), 'p', int(st.previous), 'c', int(st.current),
      'w', int(st.period), 'v', int(st.valid_from))
  end
  expire_at(st.key, expires_at, now)
end

function sliding_window.lease(st, now, q, max, max_validity)
  local p_ms = q.period / 1000
  local elapsed_ms = math.min(math.floor(math.max(now - st.start, 0) / 1000), p_ms)
  local weighted = st.previous * (p_ms - elapsed_ms) + st.current * p_ms
  local room = math.floor(math.max(q.limit * p_ms - weighted, 0) / p_ms)
  local permits = math.min(max, room)
  st.current = st.current + permits
  return permits, math.min(now + max_validity, st.start + q.period), sliding_window.taken(st, now, permits)
end
