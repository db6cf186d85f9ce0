-- GCRA. State: one integer, the theoretical arrival time, which is the
-- token bucket's instant full again (see bucket_debt in lib.lua): the two
-- admit the same requests. Reports whole requests of cost 1 remaining.

local function gcra(key, cap, rate, cost, now)
  local d, full = bucket_debt(key, cap, rate, now)
  local s = spend_ns(cost, rate)
  local one = spend_ns(1, rate)
  if d + s <= full then
    d = d + s
    return 1, math.max(math.floor((full - d) / one), 0), 0, math.ceil(d / 1000), function()
      bucket_write(key, now, d)
    end
  end
  return 0, math.max(math.floor((full - d) / one), 0), ceil_us((d + s - full) / 1000), math.ceil(d / 1000), nil
end
