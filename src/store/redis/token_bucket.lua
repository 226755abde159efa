-- Token bucket: src/algorithm/token_bucket.rs, line for line.
-- State: HASH { u = tokens in units, l = last update }. One token is q.token_units units; the
-- bucket gains q.refill_units units per microsecond.
local token_bucket = {}

function token_bucket.load(key, q)
  local v = hash_numbers(key, { 'u', 'l' })
  if v[1] == nil then
    return { key = key, units = q.burst * q.token_units, last = 0 }
  end
  return { key = key, units = v[1], last = v[2] or 0 }
end

function token_bucket.decide(st, now, q, cost)
  local scale, rate, burst = q.token_units, q.refill_units, q.burst
  local full = burst * scale
  st.units = math.min(st.units, full)
  local elapsed = math.max(now - st.last, 0)
  local missing = full - st.units
  if elapsed >= ceil_div(missing, rate) then
    st.units = full
  else
    st.units = st.units + elapsed * rate
  end
  st.last = math.max(st.last, now)

  local remaining = math.floor(st.units / scale)
  local reset_after = ceil_div(full - st.units, rate)
  if cost > burst then return { 0, burst, remaining, reset_after, -1 } end
  local need = cost * scale
  if st.units >= need then
    local left = st.units - need
    return { 1, burst, math.floor(left / scale), ceil_div(full - left, rate), -1 }
  end
  return { 0, burst, remaining, reset_after, ceil_div(need - st.units, rate) }
end

function token_bucket.commit(st, now, q, cost)
  st.units = st.units - cost * q.token_units
end

function token_bucket.refund(st, now, q, cost)
  cost = math.min(cost, q.burst)
  st.units = math.min(st.units + cost * q.token_units, q.burst * q.token_units)
end

function token_bucket.save(st, now, q)
  local full = q.burst * q.token_units
  local expires_at = 0
  if st.units < full then expires_at = st.last + ceil_div(full - st.units, q.refill_units) end
  if expires_at > now then
    redis.call('HSET', st.key, 'u', int(st.units), 'l', int(st.last))
  end
  expire_at(st.key, expires_at, now)
end

function token_bucket.lease(st, now, q, max, max_validity)
  local scale = q.token_units
  local permits = math.min(max, math.floor(st.units / scale))
  st.units = st.units - permits * scale
  return permits, now + max_validity
end
