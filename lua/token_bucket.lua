-- Token bucket. State: one integer, the instant the bucket is full again
-- (see bucket_debt in lib.lua); tokens(now) = capacity - (full - now) * rate.
-- A request passes when its spend fits: (full - now) + spend(cost) <=
-- spend(capacity), in whole ns. The key expires when the bucket would be
-- full, so idle clients cost no memory.

-- Returns allowed, remaining, retry_us, reset_us, and on success a commit.
local function token_bucket(key, cap, rate, cost, now)
  local d, full = bucket_debt(key, cap, rate, now)
  local s = spend_ns(cost, rate)
  if d + s <= full then
    d = d + s
    return 1, math.max(cap - d * rate / 1e9, 0), 0, math.ceil(d / 1000), function()
      bucket_write(key, now, d)
    end
  end
  return 0, math.max(cap - d * rate / 1e9, 0), ceil_us((d + s - full) / 1000), math.ceil(d / 1000), nil
end
