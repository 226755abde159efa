-- GCRA: src/algorithm/gcra.rs, line for line. State: STRING tat (theoretical arrival time, µs).
local gcra = {}

function gcra.load(key)
  return { key = key, tat = tonumber(redis.call('GET', key)) or 0 }
end

function gcra.decide(st, now, q, cost)
  local t, burst = q.emission, q.burst
  local horizon = burst * t
  local tat = math.max(st.tat, now)
  local ahead = tat - now
  local remaining = math.floor(math.max(horizon - ahead, 0) / t)
  if cost > burst then return { 0, burst, remaining, ahead, -1 } end
  local new_ahead = ahead + cost * t
  if new_ahead <= horizon then
    return { 1, burst, math.floor((horizon - new_ahead) / t), new_ahead, -1 }
  end
  return { 0, burst, remaining, ahead, new_ahead - horizon }
end

function gcra.commit(st, now, q, cost)
  st.tat = math.max(st.tat, now) + cost * q.emission
end

function gcra.refund(st, now, q, cost)
  cost = math.min(cost, q.burst)
  st.tat = math.max(st.tat - cost * q.emission, now)
end

function gcra.save(st, now, q)
  if st.tat > now then
    redis.call('SET', st.key, int(st.tat), 'PX', ceil_div(st.tat - now, 1000))
  else
    redis.call('DEL', st.key)
  end
end

function gcra.lease(st, now, q, max, max_validity)
  local t = q.emission
  local horizon = q.burst * t
  local tat = math.max(st.tat, now)
  local permits = math.min(max, math.floor(math.max(horizon - (tat - now), 0) / t))
  st.tat = tat + permits * t
  return permits, now + max_validity
end
