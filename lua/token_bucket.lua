-- Token bucket. State: one integer, the instant (µs) at which the bucket is
-- full again; tokens(now) = capacity - (full - now) * rate. The key expires
-- when the bucket would be full, so idle clients cost no memory.
-- Returns allowed, remaining, retry_us, reset_us, and on success a commit.
local function token_bucket(key, cap, rate, cost, now)
  local full = tonumber(read_string(key) or now) or now
  if full < now then full = now end
  local tokens = cap - (full - now) * rate / 1e6
  if tokens >= cost then
    full = full + round_us(cost * 1e6 / rate)
    return 1, math.max(cap - (full - now) * rate / 1e6, 0), 0, full - now, function()
      redis.call('SET', key, fmt_int(full), 'PX', fmt_int(math.ceil((full - now) / 1000)))
    end
  end
  return 0, math.max(tokens, 0), ceil_us((cost - tokens) * 1e6 / rate), full - now, nil
end
