-- Token bucket: src/algorithm/token_bucket.rs, line for line.
-- State: HASH { m = units missing from a full bucket, l = last update, k = units per token and
-- r = units refilled per µs when written, v = receipts from before this time refund nothing }.
-- One token is q.token_units units; the bucket gains q.refill_units units per µs.
local token_bucket = {}

function token_bucket.load(key, q)
  local v = hash_numbers(key, { 'm', 'l', 'k', 'r', 'v' })
  return {
    key = key, missing = v[1] or 0, last = v[2] or 0, scale = v[3] or q.token_units,
    rate = v[4] or q.refill_units, valid_from = v[5] or 0,
  }
end

function token_bucket.refill(st, now, rate)
  local elapsed = math.max(now - st.last, 0)
  if elapsed >= ceil_div(st.missing, rate) then
    st.missing = 0
  else
    st.missing = st.missing - elapsed * rate
  end
  st.last = math.max(st.last, now)
end

function token_bucket.decide(st, now, q, cost)
  local scale, rate, burst = q.token_units, q.refill_units, q.burst
  local full = burst * scale
  if st.scale ~= scale or st.rate ~= rate then
    -- A conversion is not a roll forward: it must be kept even by a peek or a denial.
    st.dirty = true
    -- The time since the last write refills at the rate it was written under, first.
    token_bucket.refill(st, now, math.max(st.rate, 1))
    st.missing = rescale_ceil(st.missing, st.scale, scale)
    -- Cut at the cap: refused under this quota, and kept in its own scale (see apply.lua).
    st.clamped = st.missing >= RESCALE_CAP
    st.scale = scale
    st.rate = rate
    st.valid_from = now
  end
  token_bucket.refill(st, now, rate)
  local behind = st.last - now

  local units = math.max(full - st.missing, 0)
  local remaining = math.floor(units / scale)
  local reset_after = behind + ceil_div(st.missing, rate)
  if cost > burst then return { 0, burst, remaining, reset_after, -1 } end
  local need = cost * scale
  if units >= need then
    local left = units - need
    return { 1, burst, math.floor(left / scale), behind + ceil_div(full - left, rate), -1 }
  end
  return { 0, burst, remaining, reset_after, behind + ceil_div(st.missing + need - full, rate) }
end

function token_bucket.taken(st, cost)
  if st.valid_from == 0 and cost > 0 then st.valid_from = st.last end
  return st.last
end

function token_bucket.commit(st, now, q, cost)
  st.missing = st.missing + cost * q.token_units
  return token_bucket.taken(st, cost)
end

function token_bucket.refund(st, now, q, at, cost)
  if at < st.valid_from then return end
  local scale, rate = q.token_units, q.refill_units
  local debt = math.min(cost, q.burst) * scale
  local elapsed = math.max(math.max(now, st.last) - at, 0)
  if elapsed >= ceil_div(debt, rate) then return end
  st.missing = math.max(st.missing - (debt - elapsed * rate), 0)
end

function token_bucket.save(st, now, q)
  local expires_at = 0
  if st.missing > 0 then expires_at = st.last + ceil_div(st.missing, q.refill_units) end
  if expires_at > now then
    redis.call('HSET', st.key, 'm', int(st.missing), 'l', int(st.last), 'k', int(st.scale),
      'r', int(st.rate), 'v', int(st.valid_from))
  end
  expire_at(st.key, expires_at, now)
end

function token_bucket.lease(st, now, q, max, max_validity)
  local scale = q.token_units
  local units = math.max(q.burst * scale - st.missing, 0)
  local permits = math.min(max, math.floor(units / scale))
  st.missing = st.missing + permits * scale
  return permits, now + max_validity, token_bucket.taken(st, permits)
end
